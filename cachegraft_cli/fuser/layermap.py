"""Which sharer layer (and which projector) each receiver layer reads."""

from __future__ import annotations

LayerMap = dict[int, list[tuple[int, int]]]  # receiver layer -> [(sharer layer, projector index)]


def last_aligned(receiver_layers: int, sharer_layers: int) -> LayerMap:
    """Receiver layer t of T reads sharer layer clamp(t + S - T, 0, S - 1); projector t."""
    offset = sharer_layers - receiver_layers
    return {t: [(min(max(t + offset, 0), sharer_layers - 1), t)] for t in range(receiver_layers)}


def to_published(layer_map: LayerMap) -> dict:
    """The nested `projector_config.json` form, with string keys."""
    return {"0": {"1": {str(t): [[s, p] for s, p in pairs] for t, pairs in sorted(layer_map.items())}}}


def from_published(nested: dict) -> LayerMap:
    """Parse `{receiver_model: {sharer_model: {receiver_layer: [[sharer_layer, projector]]}}}`."""
    out: LayerMap = {}
    for sharers in nested.values():
        for layers in sharers.values():
            for t, pairs in layers.items():
                out.setdefault(int(t), []).extend((int(s), int(p)) for s, p in pairs)
    return out
