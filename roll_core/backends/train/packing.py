"""Micro-batches without compute on padding: token-budget grouping and packed forwards.

Two independent switches of a train role (`actor_train.packing`,
`actor_train.max_tokens_per_micro_batch`; see :class:`TrainBackendSpec`):

* **Token-budget micro-batches** (:func:`plan_micro_batches`): rows are grouped by length
  (first-fit decreasing) so that every micro-batch holds at most the budget, counted in real
  tokens when packed and in rows x longest row when padded. A micro-batch is then trimmed to
  its own longest row (:func:`trim_width`). Objectives normalise with the *global* counts in
  `batch.meta` and never split a row, so the loss and gradients do not depend on how rows
  are grouped (every mode of roll_core/algorithms/aggregation.py).
* **Packing** (:class:`PackedRows`): the rows of a micro-batch (right-padded, as every roll
  batch is) are concatenated with per-row position ids ``0 .. len-1``. transformers builds the
  block-diagonal causal mask from position ids that restart at 0 when no 2-D attention mask is
  given (`masking_utils.find_packed_sequence_indices`), so no row attends to another. With
  flash-attention (``cu_seqlens`` from the same position ids: no mask is built) all rows form
  one sequence ``[1, S]``, ``S`` = the real tokens; sdpa / eager / flex build a dense
  ``S x S`` mask, so there rows are packed into bins (first fit decreasing) of the width that
  makes the mask smallest: never more attention than the padded micro-batch, and most of its
  padding gone. The logits are scattered back to the padded layout ``[B, T, V]`` (zeros on padding),
  so objectives see exactly what the padded path gives them.
  Vision-language models (Qwen2.5-VL): the 3-D rope position ids are computed per row on the
  padded micro-batch, exactly as the padded forward computes them, then packed, with the text
  position ids as a fourth row (the layout transformers reads packing from).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from roll_core.data import Batch
from roll_core.errors import ConfigError
from roll_core.models.routing import ROUTES_KEY, packed_routes

PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
"""Attention implementations that confine attention to each packed row (from position ids)."""


def check_packing_support(model: Any, *, role: str = "actor_train") -> bool:
    """Whether the rows are packed into one sequence (True) or into bins (False, see
    :class:`PackedRows`): one sequence where the attention reads row boundaries as
    variable-length sequences (flash-attention), and for a mixture-of-experts model whose
    router load-balancing loss is computed (`output_router_logits`): that loss averages over
    every token of the forward, so bins' filler tokens would change it. A ConfigError (before
    the first step) when the model cannot take packed input at all (an attention
    implementation outside :data:`PACKING_ATTENTION`)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in PACKING_ATTENTION:
        raise ConfigError(
            f"{role}.packing is on but the model's attention implementation {impl!r} cannot "
            "confine attention to each packed row (rows would attend to each other).",
            hint=f"Set {role}.packing: false (right-padded micro-batches), or load the model "
            f"with one of {', '.join(PACKING_ATTENTION)}.",
        )
    return str(impl).startswith("flash_attention") or bool(
        getattr(config, "output_router_logits", False)
    )


def row_lengths(batch: Batch) -> list[int]:
    """Real tokens of every row (``attention_mask`` sums); rows must be right-padded."""
    attn = batch.tensors["attention_mask"]
    lengths = attn.sum(-1)
    positions = torch.arange(attn.shape[1], device=attn.device)
    right_padded = (attn.bool() == (positions[None, :] < lengths[:, None])).all()
    if not bool(right_padded):
        raise ValueError(
            "packed and token-budget micro-batches need right-padded rows (attention_mask "
            "1 then 0); this batch has a gap or left padding"
        )
    return [int(n) for n in lengths.tolist()]


def plan_micro_batches(
    lengths: list[int],
    *,
    micro_batch_size: int,
    max_tokens: int | None,
    packed: bool,
    group: int = 1,
    role: str = "actor_train",
) -> list[list[int]]:
    """Row indices of each micro-batch.

    Without a budget: consecutive runs of `micro_batch_size` rows (as `Batch.chunk`). With
    `max_tokens`: units of `group` consecutive rows (DPO's chosen/rejected pairs) placed first
    fit in decreasing length order, so that each micro-batch costs at most `max_tokens`
    (packed: the sum of its lengths; padded: rows x its longest row). Rows keep their order
    inside a micro-batch. A unit that alone exceeds the budget is a ConfigError.
    """
    n = len(lengths)
    if max_tokens is None:
        return [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]
    units = [list(range(s, min(s + group, n))) for s in range(0, n, group)]

    def cost(rows: int, longest: int, total: int) -> int:
        return total if packed else rows * longest

    order = sorted(range(len(units)), key=lambda u: -max(lengths[i] for i in units[u]))
    bins: list[list[int]] = []
    stats: list[tuple[int, int, int]] = []  # rows, longest, total
    for u in order:
        rows = units[u]
        longest = max(lengths[i] for i in rows)
        total = sum(lengths[i] for i in rows)
        if cost(len(rows), longest, total) > max_tokens:
            what = (
                f"a row of this batch ({longest} tokens)"
                if len(rows) == 1
                else f"{len(rows)} rows that must share a micro-batch (a DPO pair: longest "
                f"{longest} tokens, {cost(len(rows), longest, total)} in all)"
            )
            raise ConfigError(
                f"{role}.max_tokens_per_micro_batch={max_tokens} is smaller than {what}.",
                hint=f"Set {role}.max_tokens_per_micro_batch to at least "
                f"{cost(len(rows), longest, total)} (the longest prompt + response the data "
                "and generation limits allow), or remove it to count rows.",
            )
        for k, (r, lo, to) in enumerate(stats):
            if cost(r + len(rows), max(lo, longest), to + total) <= max_tokens:
                bins[k].extend(rows)
                stats[k] = (r + len(rows), max(lo, longest), to + total)
                break
        else:
            bins.append(list(rows))
            stats.append((len(rows), longest, total))
    return [sorted(b) for b in bins]


def trim_width(mb: Batch, width: int) -> Batch:
    """`mb` cut to its first `width` input columns: every tensor whose second dimension is
    the input width ``T`` (``input_ids``...) or the target width ``T-1`` (``response_mask``,
    ``teacher_logprobs``...) loses its trailing (padding) columns."""
    full = mb.tensors["input_ids"].shape[1]
    if width >= full:
        return mb
    tensors = {}
    for key, value in mb.tensors.items():
        if value.ndim >= 2 and value.shape[1] == full:
            value = value[:, :width]
        elif value.ndim >= 2 and value.shape[1] == full - 1:
            value = value[:, : width - 1]
        tensors[key] = value
    return Batch(tensors=tensors, non_tensors=mb.non_tensors, meta=mb.meta)


def micro_batches(
    batch: Batch,
    *,
    micro_batch_size: int,
    max_tokens: int | None,
    packed: bool,
    group: int = 1,
) -> list[tuple[list[int], Batch]]:
    """(row indices into `batch`, micro-batch) pairs by :func:`plan_micro_batches`. Without
    packing or a budget these are `batch.chunk` (untrimmed: the padded path as it always
    was); otherwise each micro-batch is trimmed to its own longest row."""
    if not packed and max_tokens is None:
        chunks = batch.chunk(micro_batch_size) if len(batch) else []
        out, start = [], 0
        for c in chunks:
            out.append((list(range(start, start + len(c))), c))
            start += len(c)
        return out
    lengths = row_lengths(batch)
    plan = plan_micro_batches(
        lengths,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        packed=packed,
        group=group,
    )
    out = []
    for rows in plan:
        mb = batch.select(rows) if rows != list(range(len(batch))) else batch
        out.append((rows, trim_width(mb, max(1, max(lengths[i] for i in rows)))))
    return out


def split_to_count(
    parts: list[tuple[list[int], Batch]], count: int, *, group: int = 1
) -> list[tuple[list[int], Batch]]:
    """`parts` (from :func:`micro_batches`) split until there are `count` of them, or no part
    has two units of `group` rows left: each split halves the part with the most real tokens
    at the unit boundary closest to half its tokens. Data-parallel ranks must run the same
    number of micro-batches (their forwards and backwards meet in collectives); a rank with
    fewer spreads its own rows over more, smaller micro-batches instead of running copies
    whose loss is discarded. The loss does not depend on the partition (see the module
    docstring); each half stays within the budget its part met."""
    parts = list(parts)
    while len(parts) < count:
        splittable = [k for k, (rows, _) in enumerate(parts) if len(rows) >= 2 * group]
        if not splittable:
            break
        sizes = [row_lengths(mb) for _, mb in parts]
        k = max(splittable, key=lambda k: (sum(sizes[k]), -k))
        rows, mb = parts[k]
        units = [sum(sizes[k][u : u + group]) for u in range(0, len(rows), group)]
        half, run, cut = sum(units) / 2, 0, 1
        best = None
        for u in range(1, len(units)):  # cut after unit u-1: both sides keep >= 1 unit
            run += units[u - 1]
            if best is None or abs(run - half) < best:
                best, cut = abs(run - half), u
        c = cut * group
        parts[k : k + 1] = [
            (rows[:c], mb.select(list(range(c)))),
            (rows[c:], mb.select(list(range(c, len(rows))))),
        ]
    return parts


def scatter_rows(
    parts: list[tuple[list[int], torch.Tensor]], n_rows: int, width: int
) -> torch.Tensor:
    """Per-micro-batch results ``[b, w, ...]`` (w <= width) back into one ``[n_rows, width,
    ...]`` tensor in the batch's row order, zero-padded on the right."""
    if not parts:
        return torch.zeros((n_rows, width))
    first = parts[0][1]
    out = first.new_zeros((n_rows, width, *first.shape[2:]))
    for rows, value in parts:
        out[torch.tensor(rows, dtype=torch.long), : value.shape[1]] = value
    return out


def fill_bins(
    lengths: list[int], capacity: int, *, ordered: bool = False
) -> tuple[list[int], list[int], list[int]]:
    """Rows of `lengths` tokens placed into bins of `capacity` tokens: first fit in decreasing
    length order, or (`ordered`) next fit in row order. (bin of each row, its first slot there,
    tokens used per bin)."""
    fill: list[int] = []
    where, start = [0] * len(lengths), [0] * len(lengths)
    order = (
        range(len(lengths)) if ordered else sorted(range(len(lengths)), key=lambda r: -lengths[r])
    )
    for r in order:
        n = int(lengths[r])
        if ordered:
            b = len(fill) - 1 if fill and fill[-1] + n <= capacity else len(fill)
        else:
            b = next((k for k, used in enumerate(fill) if used + n <= capacity), len(fill))
        if b == len(fill):
            fill.append(0)
        where[r], start[r] = b, fill[b]
        fill[b] += n
    return where, start, fill


@dataclass
class PackedRows:
    """Where each token of a packed micro-batch comes from and goes to: the token at
    ``rows[k], cols[k]`` of the padded micro-batch sits at ``bins[k], slots[k]`` of the packed
    ``[n_bins, width]`` layout (row-major order, padding left out).

    Two layouts (:meth:`from_mask`): one sequence ``[1, S]`` (``S`` = the real tokens) for
    attention kernels that read row boundaries from the position ids as variable-length
    sequences (flash-attention's ``cu_seqlens``), and *bins* for kernels that build a dense
    mask from them (sdpa, eager, flex): rows placed first fit in decreasing length order into
    sequences whose width is the cheapest for that mask (bins x width^2) among the longest
    row times a power of two and the whole length. Width = the longest row never costs more
    than the padded micro-batch; one sequence of many short rows would cost many times more
    (``S x S``); a few rows next to one long row share one sequence. A bin's
    unused tail is filler: its own segment (positions restarting at 0), never attended to by
    the rows and dropped on unpacking.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    bins: torch.Tensor
    slots: torch.Tensor
    batch_size: int
    width: int
    n_bins: int
    bin_width: int

    @classmethod
    def from_mask(
        cls, attention_mask: torch.Tensor, *, varlen: bool = False, ordered: bool = False
    ) -> PackedRows:
        """The layout of a right-padded micro-batch. `ordered`: bins filled in row order
        (next fit), so the packed tokens keep the batch's order: a vision-language model
        places the images' features in token order."""
        rows, cols = attention_mask.bool().nonzero(as_tuple=True)
        batch_size, width = attention_mask.shape
        lengths = attention_mask.sum(-1).tolist()
        if varlen or batch_size == 0:
            total = int(rows.numel())
            slots = torch.arange(total, device=rows.device)
            return cls(rows, cols, torch.zeros_like(rows), slots, batch_size, width, 1, total)
        longest, total = max(1, int(max(lengths))), int(sum(lengths))
        widths = [longest << k for k in range(total.bit_length()) if longest << k < total]
        # the dense mask costs bins x width^2: the cheapest of these widths (ties: narrower)
        capacity, (where, start, fill) = min(
            ((w, fill_bins(lengths, w, ordered=ordered)) for w in [*widths, max(total, 1)]),
            key=lambda c: (len(c[1][2]) * c[0] ** 2, c[0]),
        )
        bins = torch.tensor(where, dtype=torch.long, device=rows.device)[rows]
        slots = torch.tensor(start, dtype=torch.long, device=rows.device)[rows] + cols
        return cls(rows, cols, bins, slots, batch_size, width, len(fill), capacity)

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` -> ``[n_bins, bin_width, ...]`` (filler: zeros)."""
        out = padded.new_zeros((self.n_bins, self.bin_width, *padded.shape[2:]))
        out[self.bins, self.slots] = padded[self.rows, self.cols]
        return out

    def position_ids(self) -> torch.Tensor:
        """``[n_bins, bin_width]``: 0 .. len-1 within each row; a bin's filler restarts at 0."""
        device = self.rows.device
        free = torch.ones((self.n_bins, self.bin_width), dtype=torch.bool, device=device)
        free[self.bins, self.slots] = False
        used = (~free).sum(-1, keepdim=True)
        filler = torch.arange(self.bin_width, device=device)[None, :] - used
        positions = torch.where(free, filler, torch.zeros_like(filler))
        positions[self.bins, self.slots] = self.cols
        return positions

    def spread(self, values: torch.Tensor, filler: torch.Tensor) -> torch.Tensor:
        """Per-token ``[..., S]`` values (token order of :attr:`rows`) laid out as
        ``[..., n_bins, bin_width]``, `filler` ``[..., n_bins, bin_width]`` elsewhere."""
        out = filler.clone().to(values)
        out[..., self.bins, self.slots] = values
        return out

    def keep_indices(self, first_col: int) -> torch.Tensor:
        """The packed columns (slots) holding a token of column >= `first_col` in any bin
        (transformers' tensor form of `logits_to_keep`), ascending."""
        return torch.unique(self.slots[self.cols >= first_col])

    def unpack(self, packed: torch.Tensor, *, first_col: int = 0) -> torch.Tensor:
        """Packed values ``[n_bins, bin_width, ...]``, or only the columns
        :meth:`keep_indices` (`first_col`) gives -> ``[B, T - first_col, ...]``, zeros on
        padding (autograd flows through)."""
        keep = self.cols >= first_col
        rows, cols = self.rows[keep], self.cols[keep] - first_col
        bins, slots = self.bins[keep], self.slots[keep]
        if packed.shape[1] != self.bin_width:  # logits_to_keep cut the packed columns
            where = torch.full((self.bin_width,), -1, dtype=torch.long, device=slots.device)
            kept = self.keep_indices(first_col)
            where[kept] = torch.arange(kept.numel(), device=slots.device)
            slots = where[slots]
        out = packed.new_zeros((self.batch_size, self.width - first_col, *packed.shape[2:]))
        return out.index_put((rows, cols), packed[bins, slots])


def rope_module(model: Any) -> Any:
    """The submodule that computes a vision-language model's 3-D rope position ids
    (`compute_3d_position_ids`, Qwen2.5-VL and relatives), or None for a text model."""
    for module in model.modules():
        if hasattr(module, "compute_3d_position_ids"):
            return module
    return None


def packed_inputs(
    mb: Batch,
    device: torch.device,
    *,
    logits_from: int = 0,
    vision: dict[str, torch.Tensor] | None = None,
    rope: Any = None,
    varlen: bool = False,
) -> tuple[dict[str, Any], PackedRows]:
    """The model keyword arguments of micro-batch `mb` packed (one sequence when `varlen`,
    see :func:`check_packing_support`, else bins: :class:`PackedRows`), and the layout to
    unpack the outputs with. `rope`: see :func:`rope_module` (VLMs)."""
    ids = mb.tensors["input_ids"].to(device)
    attn = mb.tensors["attention_mask"].to(device)
    vision = dict(vision or {})
    layout = PackedRows.from_mask(attn, varlen=varlen, ordered="pixel_values" in vision)
    positions = layout.position_ids()
    token_types = vision.pop("mm_token_type_ids", None)  # [B, T]: 3-D rope needs them
    if rope is not None:
        three_d = rope.compute_3d_position_ids(
            input_ids=ids,
            image_grid_thw=vision.get("image_grid_thw"),
            video_grid_thw=None,
            inputs_embeds=None,
            attention_mask=attn,
            past_key_values=None,
            mm_token_type_ids=token_types.to(device) if token_types is not None else None,
        )
        text = positions[None].expand(3, -1, -1)
        if three_d is None:  # what the padded forward uses then: 0.. per row in all three
            three_d = text
        else:
            three_d = layout.spread(three_d[:, layout.rows, layout.cols], text)
        positions = torch.cat([positions[None], three_d.to(positions)], dim=0)  # [4, bins, W]
    kwargs: dict[str, Any] = {
        "input_ids": layout.pack(ids),
        "position_ids": positions,
        "attention_mask": None,
        "use_cache": False,
        **vision,
    }
    if logits_from > 0:
        kwargs["logits_to_keep"] = layout.keep_indices(logits_from)
    return kwargs, layout


def model_forward(
    call: Callable[..., Any],
    mb: Batch,
    device: torch.device,
    *,
    packing: bool,
    rope: Any = None,
    logits_from: int = 0,
    vision: dict[str, torch.Tensor] | None = None,
    varlen: bool = False,
    replay: Any = None,
) -> Any:
    """`call(**inputs)` (a causal LM's forward) on micro-batch `mb`, packed or padded; the
    output's ``logits`` are ``[B, T - logits_from, V]`` either way (zeros on padding when
    packed), so callers cannot tell the two paths apart. `vision` with images must carry
    ``mm_token_type_ids`` (``vision_model_inputs(..., image_token_id=...)``): without them the
    model would give the image tokens 1-D positions, not the 3-D ones it was trained with.
    `replay` (a RouterReplay, roll_core/models/routing.py): the forward routes every token
    through the experts `mb`'s ``routed_experts`` recorded (packed with the tokens)."""
    if vision and "pixel_values" in vision and "mm_token_type_ids" not in vision:
        raise ValueError(
            "model_forward: vision inputs without mm_token_type_ids; build them with "
            "vision_model_inputs(batch, device, image_token_id=image_token_id(model.config)) "
            "so the image tokens get the model's 3-D rope positions"
        )
    if packing:
        kwargs, layout = packed_inputs(
            mb, device, logits_from=logits_from, vision=vision, rope=rope, varlen=varlen
        )
        if replay is not None:
            routes = mb.tensors.get(ROUTES_KEY)
            replay.set(None if routes is None else packed_routes(routes.to(device), layout.pack))
        out = call(**kwargs)
        out.logits = layout.unpack(out.logits, first_col=logits_from)
        return out
    ids = mb.tensors["input_ids"].to(device)
    attn = mb.tensors["attention_mask"].to(device)
    if replay is not None:
        routes = mb.tensors.get(ROUTES_KEY)
        replay.set(None if routes is None else routes.to(device))
    keep = {"logits_to_keep": ids.shape[1] - logits_from} if logits_from > 0 else {}
    return call(input_ids=ids, attention_mask=attn, use_cache=False, **keep, **(vision or {}))


def pad_log_probs(parts: list[tuple[list[int], torch.Tensor]], batch: Batch) -> torch.Tensor:
    """Per-micro-batch log-probs back into ``[B, T-1]`` in row order, 0 where a row has no
    next token (padding)."""
    width = batch.tensors["input_ids"].shape[1] - 1
    out = scatter_rows(parts, len(batch), width)
    valid = batch.tensors["attention_mask"][:, 1:].to(out.device).bool()
    return out.masked_fill(~valid, 0.0)
