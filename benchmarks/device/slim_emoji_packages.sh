#!/usr/bin/env bash
# emoji-zh's npm packages slimmed to what `rapiddiff data emoji` reads, small enough to travel to the
# device machine (150 MB of tarballs → ~11 MB; the builder's output is byte-identical either way).
#   bash benchmarks/device/slim_emoji_packages.sh TGZ_DIR DEST      # TGZ_DIR: the `npm pack` tarballs
# Keeps package.json and LICENSE of each package, emoji.json and the 64 px artwork of the catalogue's
# emoji (not every skin tone), CLDR's zh / zh-Hant annotations, emojibase's zh messages, cldr-misc's
# zh character labels; the SVG packages (@iconify-json/*, ~5 MB) are copied as they are.
set -euo pipefail
src=$(realpath "$1"); dest=$(realpath -m "$2"); mkdir -p "$dest"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
for tgz in "$src"/*.tgz; do
  name=$(basename "$tgz" .tgz)
  case $name in
    iconify-json-*) cp "$tgz" "$dest/"; continue ;;
    emoji-datasource-google-*) keep="package/emoji.json package/img/google/64" ;;
    emoji-datasource-twitter-*) keep="package/emoji.json package/img/twitter/64" ;;
    cldr-annotations-full-*) keep="package/annotations/zh package/annotations/zh-Hant" ;;
    cldr-annotations-derived-full-*) keep="package/annotationsDerived/zh package/annotationsDerived/zh-Hant" ;;
    emojibase-data-*) keep="package/zh/messages.json" ;;
    cldr-misc-full-*) keep="package/main/zh/characterLabels.json" ;;
    *) echo "skipping $name (not an emoji-zh package)"; continue ;;
  esac
  mkdir -p "$work/$name" && tar xzf "$tgz" -C "$work/$name"
done
# the artwork of the emoji the builder catalogues: a build from the full packages lists them
python3 -m rapiddiff data emoji --out "$work/full" --package "$src" --no-hr-copies > "$work/build.log" 2>&1 \
  || { tail -20 "$work/build.log"; exit 1; }
python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
ids = {json.loads(line)["id"] for line in open(f"{work}/full/entities.jsonl", encoding="utf-8")}
catalogue = json.load(open(next(__import__("glob").iglob(f"{work}/emoji-datasource-google-*/package/emoji.json"))))
keep = sorted({e["image"] for e in catalogue for k in ("unified", "non_qualified") if (e.get(k) or "").lower() in ids})
open(f"{work}/keep.txt", "w").write("".join(f"{name}\n" for name in keep))
PY
for dir in "$work"/*/; do
  name=$(basename "$dir"); [ -d "$dir/package" ] || continue
  case $name in
    emoji-datasource-google-*) style=google ;; emoji-datasource-twitter-*) style=twitter ;; *) style= ;;
  esac
  (cd "$dir"
   files=(package/package.json $(ls -d package/LICEN* 2>/dev/null))
   if [ -n "$style" ]; then
     files+=(package/emoji.json)
     while read -r img; do [ -f "package/img/$style/64/$img" ] && files+=("package/img/$style/64/$img"); done < "$work/keep.txt"
   else
     case $name in
       cldr-annotations-full-*) files+=(package/annotations/zh package/annotations/zh-Hant) ;;
       cldr-annotations-derived-full-*) files+=(package/annotationsDerived/zh package/annotationsDerived/zh-Hant) ;;
       emojibase-data-*) files+=(package/zh/messages.json) ;;
       cldr-misc-full-*) files+=(package/main/zh/characterLabels.json) ;;
     esac
   fi
   tar czf "$dest/$name.tgz" "${files[@]}")
done
du -sh "$dest"
