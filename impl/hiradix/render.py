"""Pictures of a HiRadixCache's tree by tier: text for terminals, SVG for documents.

Every node shows where its pages live -- device (D), host (H), storage (S, when a
``StorageTier`` is given and attached: how many of the node's pages the backend holds)
-- and the two counters a reader debugging a cache wants to see: ``lock_ref``
(INV-LOCK-MONOTONE: locks on the node or below it) and ``host_ref`` (INV-HOST-PROTECT:
holders forbidding the release of its host copy). Nodes covered by a copy in flight
(INV-TRANSFER-PINNED) are marked with the copy's direction.

The renderers read public attributes only (``cache.root``, node fields, ``cache.pending``,
the pools' counts, the tier's backend and identity) and change nothing: asking a backend
``has_page`` is a read. ``hiradix.conformance.show`` is the ``hiradix show`` command (a
demo cache, or a trace replayed on the implementation) drawn by these.
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape

from hiradix.cache import HiRadixCache
from hiradix.storage.hashing import page_hashes
from hiradix.storage.tier import StorageTier
from hiradix.tree import TreeNode

TOKENS_SHOWN = 6  # tokens printed per node before "…"


@dataclass(frozen=True)
class NodeView:
    """What the renderers draw of one node (the root has none)."""

    node: TreeNode
    depth: int  # 1 for a child of the root
    pages: int
    stored: int | None  # pages the storage backend holds; None: no tier attached
    copying: tuple[str, ...]  # directions of the copies in flight covering the node

    @property
    def tier(self) -> str:
        """Where the node's KV lives, in words."""
        on_device, on_host = self.node.device is not None, self.node.host is not None
        if on_device and on_host:
            return "device+host"
        if on_device:
            return "device only"
        if on_host:
            return "host only"
        return "storage only" if self.stored else "nowhere"

    def flags(self) -> str:
        """``DHS``-style presence flags, a dash where a tier lacks the node."""
        device = "D" if self.node.device is not None else "-"
        host = "H" if self.node.host is not None else "-"
        if self.stored is None:
            return device + host
        return device + host + ("S" if self.stored == self.pages else
                                "s" if self.stored else "-")

    def tokens(self) -> str:
        shown = self.node.tokens[:TOKENS_SHOWN]
        more = "…" if len(self.node.tokens) > TOKENS_SHOWN else ""
        return "[" + " ".join(map(str, shown)) + more + "]"

    def counters(self) -> list[str]:
        """The counters worth a reader's attention (zero ones are left out)."""
        node, parts = self.node, []
        if node.lock_ref:
            parts.append(f"lock={node.lock_ref}")
        if node.host_ref:
            parts.append(f"host_ref={node.host_ref}")
        if self.stored is not None:
            parts.append(f"stored {self.stored}/{self.pages}")
        for direction in self.copying:
            parts.append(f"copying {direction}")
        return parts


def _copies(cache: HiRadixCache) -> dict[TreeNode, tuple[str, ...]]:
    covered: dict[TreeNode, tuple[str, ...]] = {}
    for direction, queue in cache.pending.items():
        for copy in queue:
            for node in copy.nodes() or ():
                covered[node] = (*covered.get(node, ()), direction)
    return covered


def _stored_pages(tier: StorageTier | None) -> tuple[object, object] | None:
    """The attached backend and page identity, or None when no tier is attached."""
    if tier is None or tier.backend is None or tier.identity is None:
        return None
    return tier.backend, tier.identity


def views(cache: HiRadixCache, tier: StorageTier | None = None) -> list[NodeView]:
    """Every node below the root in drawing order (depth first, children by first
    token), with what the renderers show of it."""
    if tier is not None and tier.cache is not cache:
        raise ValueError("tier: belongs to another cache")
    copies = _copies(cache)
    storage = _stored_pages(tier)
    size = cache.page_size
    out: list[NodeView] = []

    def visit(node: TreeNode, depth: int, parent_hash: str | None) -> None:
        children = sorted(node.children.values(),
                          key=lambda c: (c.namespace or "", c.tokens[:size]))
        for child in children:
            pages = len(child.tokens) // size
            stored, last = None, None
            if storage is not None and tier is not None:
                backend, identity = tier.backend, tier.identity
                assert backend is not None and identity is not None
                hashes = page_hashes(list(child.tokens), size, identity, child.namespace,
                                     parent_hash)
                stored = sum(backend.has_page(h) for h in hashes)
                last = hashes[-1] if hashes else parent_hash
            out.append(NodeView(child, depth, pages, stored, copies.get(child, ())))
            visit(child, depth + 1, last)

    visit(cache.root, 1, None)
    return out


def _summary(cache: HiRadixCache, tier: StorageTier | None) -> list[str]:
    device, host = cache.device_pool, cache.host_pool
    lines = [f"HiRadixCache: page size {cache.page_size}, {len(cache.nodes())} nodes; "
             f"device {device.num_slots - device.num_free_slots}/{device.num_slots} slots "
             f"in use, host {host.num_slots - host.num_free_slots}/{host.num_slots}; "
             f"evictable {cache.evictable_size()} tokens, protected "
             f"{cache.protected_size()}; copies in flight d2h={len(cache.pending['d2h'])} "
             f"h2d={len(cache.pending['h2d'])}"]
    if tier is not None and tier.backend is not None:
        lines.append(f"storage: {tier.backend.name} attached")
    else:
        lines.append("storage: none attached")
    return lines


LEGEND = ("flags: D device, H host, S all pages in storage (s: some); lock = lock_ref, "
          "host_ref = host copy protected")


def render_text(cache: HiRadixCache, tier: StorageTier | None = None) -> str:
    """The tree as indented text, one node per line, with its tier flags and counters."""
    lines = [*_summary(cache, tier), LEGEND, "root"]
    shown = views(cache, tier)
    for index, view in enumerate(shown):
        # A node is the last of its siblings if no later node at its depth comes before
        # the next shallower one; the same test on each ancestor draws the guide lines.
        def last_at(position: int, depth: int) -> bool:
            for later in shown[position + 1:]:
                if later.depth < depth:
                    return True
                if later.depth == depth:
                    return False
            return True

        guides = ""
        ancestor = index
        prefix_parts: list[str] = []
        for depth in range(view.depth - 1, 0, -1):
            while shown[ancestor].depth > depth:
                ancestor -= 1
            prefix_parts.append("    " if last_at(ancestor, depth) else "│   ")
        guides = "".join(reversed(prefix_parts))
        branch = "└── " if last_at(index, view.depth) else "├── "
        namespace = f"{view.node.namespace}: " if view.node.namespace is not None else ""
        parts = [f"{namespace}{view.tokens()}", f"{view.pages}p", view.flags(), view.tier,
                 *view.counters()]
        lines.append(guides + branch + "  ".join(parts))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- SVG

BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN, HEADER = 210, 66, 40, 14, 16, 68
STORED = "#9467bd"  # the stripe on a box's right edge: the share of pages in storage
FILL = {"device+host": "#8fd18f", "device only": "#8fb8e8", "host only": "#f3c178",
        "storage only": "#c9b3e6", "nowhere": "#dddddd"}


def _layout(shown: list[NodeView]) -> dict[int, tuple[float, float]]:
    """Top-left corner of each node's box: x by depth, y by leaf row (a parent centred
    on its children)."""
    place: dict[int, tuple[float, float]] = {}
    row = 0

    def centre(start: int) -> float:
        nonlocal row
        view = shown[start]
        x = MARGIN + (view.depth - 1) * (BOX_W + GAP_X) + 40
        ys = []
        position = start + 1
        while position < len(shown) and shown[position].depth > view.depth:
            if shown[position].depth == view.depth + 1:
                ys.append(centre(position))
            position += 1
        if ys:
            y = (ys[0] + ys[-1]) / 2
        else:
            y = HEADER + row * (BOX_H + GAP_Y)
            row += 1
        place[start] = (x, y)
        return y

    for index, view in enumerate(shown):
        if view.depth == 1:
            centre(index)
    return place


def render_svg(cache: HiRadixCache, tier: StorageTier | None = None) -> str:
    """The tree as a standalone SVG document: one ``<g class="node">`` per node, filled by
    tier, a thick red border for a lock, a dashed border for host protection."""
    shown = views(cache, tier)
    place = _layout(shown)
    rows = max((y for _, y in place.values()), default=HEADER) + BOX_H + MARGIN
    depth = max((v.depth for v in shown), default=0)
    width = max(MARGIN * 2 + 40 + depth * (BOX_W + GAP_X), 760)
    height = max(rows, HEADER + BOX_H + MARGIN + 40)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
           f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
           'font-family="monospace" font-size="11">',
           f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>']
    for line_no, line in enumerate(_summary(cache, tier)):
        out.append(f'<text x="{MARGIN}" y="{18 + 14 * line_no}">{escape(line)}</text>')
    legend_x = MARGIN
    for label, colour in FILL.items():
        if label in ("storage only", "nowhere"):
            continue  # a node of the tree is always on device or host
        out.append(f'<rect x="{legend_x}" y="42" width="12" height="12" fill="{colour}" '
                   'stroke="#444"/>')
        out.append(f'<text x="{legend_x + 16}" y="52">{label}</text>')
        legend_x += 24 + 7 * len(label)
    out.append(f'<rect x="{legend_x}" y="42" width="6" height="12" fill="{STORED}"/>')
    out.append(f'<text x="{legend_x + 10}" y="52">in storage   red border: locked   '
               'dashed border: host_ref &gt; 0</text>')
    root_y = ((min(y for _, y in place.values()) + max(y for _, y in place.values())) / 2
              if place else HEADER)
    out.append(f'<g class="root"><circle cx="{MARGIN + 10}" cy="{root_y + BOX_H / 2}" r="8" '
               'fill="#444"/></g>')
    parents: list[tuple[float, float]] = [(MARGIN + 18, root_y + BOX_H / 2)]
    for index, view in enumerate(shown):
        x, y = place[index]
        del parents[view.depth:]
        px, py = parents[view.depth - 1]
        out.append(f'<path class="edge" d="M{px:.0f},{py:.0f} C{px + GAP_X / 2:.0f},{py:.0f} '
                   f'{x - GAP_X / 2:.0f},{y + BOX_H / 2:.0f} {x:.0f},{y + BOX_H / 2:.0f}" '
                   'fill="none" stroke="#888"/>')
        parents.append((x + BOX_W, y + BOX_H / 2))
        out.append(_node_svg(view, x, y))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _node_svg(view: NodeView, x: float, y: float) -> str:
    node = view.node
    stroke, width, dash = "#444", 1, ""
    if node.lock_ref:
        stroke, width = "#d62728", 3
    if node.host_ref:
        dash = ' stroke-dasharray="6,3"'
    title = escape(f"node {node.id}: {len(node.tokens)} tokens, {view.tier}, "
                   f"lock_ref={node.lock_ref}, host_ref={node.host_ref}, hits={node.hits}")
    namespace = f"{node.namespace}: " if node.namespace is not None else ""
    parts = [f'<g class="node" id="node-{node.id}" data-tier="{view.tier}" '
             f'data-lock-ref="{node.lock_ref}" data-host-ref="{node.host_ref}">',
             f"<title>{title}</title>",
             f'<rect x="{x:.0f}" y="{y:.0f}" width="{BOX_W}" height="{BOX_H}" rx="6" '
             f'fill="{FILL[view.tier]}" stroke="{stroke}" stroke-width="{width}"{dash}/>',
             f'<text x="{x + 6:.0f}" y="{y + 15:.0f}">{escape(namespace + view.tokens())}'
             "</text>",
             f'<text x="{x + 6:.0f}" y="{y + 30:.0f}">{view.pages}p {view.flags()} '
             f"{escape(view.tier)}</text>"]
    if view.stored:
        share = BOX_H * view.stored / view.pages
        parts.append(f'<rect class="stored" x="{x + BOX_W - 10:.0f}" '
                     f'y="{y + BOX_H - share:.0f}" width="8" height="{share:.0f}" '
                     f'fill="{STORED}"/>')
    counters = view.counters()
    if counters:
        parts.append(f'<text x="{x + 6:.0f}" y="{y + 45:.0f}">'
                     f"{escape('  '.join(counters[:2]))}</text>")
    if len(counters) > 2:
        parts.append(f'<text x="{x + 6:.0f}" y="{y + 58:.0f}">'
                     f"{escape('  '.join(counters[2:]))}</text>")
    parts.append("</g>")
    return "".join(parts)


__all__ = ["NodeView", "render_svg", "render_text", "views"]
