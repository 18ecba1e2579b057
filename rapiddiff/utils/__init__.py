"""Helpers every stage needs: config loading, safe weight I/O, logging, devices.

They sit below ``kg`` in the import order (DESIGN.md: a helper two stages need lives in the
lower one), and import nothing from rapiddiff.
"""
