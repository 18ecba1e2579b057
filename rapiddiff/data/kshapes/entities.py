"""The kshapes entities: real Chinese nouns with the colour and shape they have in reality,
and the knowledge graph that states those facts (and a few more, so TransE has structure).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rapiddiff.data.kshapes.palette import BACKGROUNDS, COLOURS, SHAPES


@dataclass(frozen=True)
class Entity:
    name: str
    colour: str
    shape: str
    category: str
    aliases: tuple[str, ...] = ()
    facts: dict[str, str] = field(default_factory=dict)  # relation → tail, beyond colour/shape/category


def _e(name: str, aliases: str, colour: str, shape: str, category: str, **facts: str) -> Entity:
    return Entity(name, colour, shape, category, tuple(a for a in aliases.split("|") if a), facts)


# (colour, shape) as the thing looks to most people; extra facts use the relations 口味 (taste),
# 季节 (season), 产地 (origin), 栖息地 (habitat), 用途 (use), 时间 (time of day).
ENTITIES: tuple[Entity, ...] = (
    # 红色
    _e("番茄", "西红柿", "红色", "圆形", "蔬菜", 口味="酸甜", 季节="夏季"),
    _e("苹果", "", "红色", "圆形", "水果", 口味="甜", 产地="山东"),
    _e("樱桃", "车厘子", "红色", "圆形", "水果", 口味="甜", 季节="夏季"),
    _e("草莓", "", "红色", "三角形", "水果", 口味="酸甜", 季节="春季"),
    _e("辣椒", "红辣椒", "红色", "长条形", "蔬菜", 口味="辣", 产地="四川"),
    _e("火龙果", "", "红色", "椭圆形", "水果", 口味="甜", 产地="广西"),
    _e("螺蛳粉", "", "红色", "圆形", "食品", 口味="酸辣", 产地="广西"),
    _e("砖头", "红砖", "红色", "方形", "物品", 用途="建筑"),
    _e("五角星", "", "红色", "星形", "物品", 用途="装饰"),
    _e("瓢虫", "七星瓢虫", "红色", "圆形", "动物", 栖息地="草地"),
    # 黄色
    _e("香蕉", "", "黄色", "长条形", "水果", 口味="甜", 产地="海南"),
    _e("柠檬", "", "黄色", "椭圆形", "水果", 口味="酸", 产地="四川"),
    _e("芒果", "", "黄色", "椭圆形", "水果", 口味="甜", 产地="海南"),
    _e("玉米", "苞米", "黄色", "长条形", "蔬菜", 季节="秋季", 产地="东北"),
    _e("月饼", "", "黄色", "圆形", "食品", 口味="甜", 季节="秋季"),
    _e("杨桃", "阳桃", "黄色", "星形", "水果", 口味="酸甜", 产地="广东"),
    _e("金字塔", "", "黄色", "三角形", "建筑", 产地="埃及"),
    _e("铅笔", "", "黄色", "长条形", "物品", 用途="写字"),
    _e("月亮", "月球", "黄色", "圆形", "天体", 时间="夜晚"),
    _e("星星", "", "黄色", "星形", "天体", 时间="夜晚"),
    # 绿色
    _e("西瓜", "", "绿色", "圆形", "水果", 口味="甜", 季节="夏季"),
    _e("黄瓜", "青瓜", "绿色", "长条形", "蔬菜", 口味="清淡", 季节="夏季"),
    _e("粽子", "", "绿色", "三角形", "食品", 季节="夏季"),
    _e("圣诞树", "", "绿色", "三角形", "植物", 季节="冬季"),
    _e("青蛙", "", "绿色", "圆形", "动物", 栖息地="池塘"),
    _e("乌龟", "", "绿色", "椭圆形", "动物", 栖息地="池塘"),
    _e("冬瓜", "", "绿色", "椭圆形", "蔬菜", 口味="清淡", 季节="夏季"),
    _e("邮筒", "", "绿色", "方形", "物品", 用途="寄信"),
    _e("竹子", "", "绿色", "长条形", "植物", 产地="四川"),
    # 蓝色
    _e("蓝莓", "", "蓝色", "圆形", "水果", 口味="酸甜"),
    _e("地球", "", "蓝色", "圆形", "天体", 时间="白天"),
    _e("蓝鲸", "", "蓝色", "椭圆形", "动物", 栖息地="海洋"),
    _e("海豚", "", "蓝色", "椭圆形", "动物", 栖息地="海洋"),
    _e("牛仔裤", "", "蓝色", "长条形", "物品", 用途="穿着"),
    _e("帐篷", "", "蓝色", "三角形", "物品", 用途="露营"),
    _e("集装箱", "", "蓝色", "方形", "物品", 用途="运输"),
    # 紫色
    _e("葡萄", "提子", "紫色", "圆形", "水果", 口味="甜", 产地="新疆"),
    _e("茄子", "", "紫色", "椭圆形", "蔬菜", 季节="夏季"),
    _e("紫薯", "", "紫色", "椭圆形", "蔬菜", 口味="甜"),
    _e("薰衣草", "", "紫色", "长条形", "植物", 产地="新疆"),
    _e("洋葱", "葱头", "紫色", "圆形", "蔬菜", 口味="辣"),
    _e("紫菜", "", "紫色", "方形", "食品", 口味="咸", 产地="福建"),
    # 橙色
    _e("橙子", "甜橙", "橙色", "圆形", "水果", 口味="酸甜", 产地="江西"),
    _e("橘子", "桔子", "橙色", "圆形", "水果", 季节="冬季"),
    _e("胡萝卜", "红萝卜", "橙色", "长条形", "蔬菜", 口味="甜"),
    _e("南瓜", "", "橙色", "圆形", "蔬菜", 口味="甜", 季节="秋季"),
    _e("海星", "", "橙色", "星形", "动物", 栖息地="海洋"),
    _e("金鱼", "", "橙色", "椭圆形", "动物", 栖息地="池塘"),
    _e("太阳", "", "橙色", "圆形", "天体", 时间="白天"),
    _e("交通锥", "路锥", "橙色", "三角形", "物品", 用途="交通"),
    # 白色
    _e("鸡蛋", "", "白色", "椭圆形", "食品"),
    _e("豆腐", "", "白色", "方形", "食品", 口味="清淡"),
    _e("馒头", "", "白色", "圆形", "食品", 产地="山东"),
    _e("大蒜", "蒜头", "白色", "圆形", "蔬菜", 口味="辣"),
    _e("雪花", "", "白色", "星形", "自然", 季节="冬季"),
    _e("饺子", "", "白色", "椭圆形", "食品", 季节="冬季"),
    _e("汤圆", "元宵", "白色", "圆形", "食品", 口味="甜", 季节="冬季"),
    _e("熊猫", "大熊猫", "白色", "圆形", "动物", 栖息地="竹林", 产地="四川"),
    _e("三明治", "", "白色", "三角形", "食品"),
    _e("粉笔", "", "白色", "长条形", "物品", 用途="写字"),
    # 黑色
    _e("巧克力", "", "黑色", "方形", "食品", 口味="甜"),
    _e("煤炭", "", "黑色", "方形", "物品", 用途="燃料", 产地="山西"),
    _e("黑板", "", "黑色", "方形", "物品", 用途="写字"),
    _e("企鹅", "", "黑色", "椭圆形", "动物", 栖息地="南极"),
    _e("黑豆", "", "黑色", "圆形", "食品"),
    _e("筷子", "", "黑色", "长条形", "物品", 用途="吃饭"),
)

ENTITY_BY_NAME: dict[str, Entity] = {e.name: e for e in ENTITIES}


def choose_heldout(
    n: int, seed: int, entities: tuple[Entity, ...] = ENTITIES, *, stream: int = 7
) -> list[str]:
    """``n`` entities to keep out of every training caption, spread over the colours.

    Round-robin over colours (in a seed-shuffled order), skipping an entity whose removal would
    leave its colour or its shape with fewer than 2 seen entities: every attribute must stay
    learnable from seen entities, or no model could be expected to transfer it. ``stream``
    separates independent draws from one seed (7: the test held-out set).
    """
    if not 0 <= n <= len(entities) // 2:
        raise ValueError(f"heldout must be between 0 and {len(entities) // 2}, got {n}")
    rng = np.random.default_rng([seed, stream])
    by_colour: dict[str, list[Entity]] = {}
    for e in entities:
        by_colour.setdefault(e.colour, []).append(e)
    queues = [list(rng.permutation(group)) for group in by_colour.values()]
    order = list(rng.permutation(len(queues)))
    seen_colour = {c: len(g) for c, g in by_colour.items()}
    seen_shape = {s: sum(e.shape == s for e in entities) for s in SHAPES}
    chosen: list[str] = []
    while len(chosen) < n and any(queues):
        for qi in order:
            if len(chosen) == n:
                break
            queue = queues[qi]
            while queue:
                e = queue.pop(0)
                if seen_colour[e.colour] > 2 and seen_shape[e.shape] > 2:
                    seen_colour[e.colour] -= 1
                    seen_shape[e.shape] -= 1
                    chosen.append(e.name)
                    break
    if len(chosen) < n:
        raise ValueError(f"cannot hold out {n} entities and keep every colour and shape seen twice")
    return sorted(chosen, key=[e.name for e in entities].index)


def choose_validation(n: int, seed: int, heldout: list[str] | set[str]) -> list[str]:
    """``n`` more KG-only entities, disjoint from the test ``heldout`` ones: the validation set that
    checkpoints and recipes are selected on (never the test set). Chosen by the same rule among the
    entities left after ``heldout``, so every colour and shape keeps ≥ 2 seen entities after both."""
    rest = tuple(e for e in ENTITIES if e.name not in set(heldout))
    return choose_heldout(n, seed, rest, stream=8)


def kg_triples(entities: tuple[Entity, ...] = ENTITIES) -> list[tuple[str, str, str]]:
    """The KG's facts as (head, relation, tail) names; attribute values are entities too."""
    triples: list[tuple[str, str, str]] = []
    for e in entities:
        triples += [(e.name, "颜色", e.colour), (e.name, "形状", e.shape), (e.name, "类别", e.category)]
        triples += [(e.name, rel, tail) for rel, tail in e.facts.items()]
    # The attribute words themselves, typed, so their vectors cluster by kind.
    triples += [(c, "类别", "颜色") for c in COLOURS]
    triples += [(s, "类别", "形状") for s in SHAPES]
    for b, (_, tone) in BACKGROUNDS.items():
        triples += [(b, "类别", "背景色"), (b, "色调", tone)]
    return triples


def kg_aliases(entities: tuple[Entity, ...] = ENTITIES) -> dict[str, list[str]]:
    return {e.name: list(e.aliases) for e in entities if e.aliases}
