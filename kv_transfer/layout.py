"""`KVLayout`: the shape of one request's KV in transfer layout, and its byte map.

Two forms, one per kind of transfer:

* whole-model (`model_kv_heads == 0`, every TP=1 transfer): per layer
  `[2, num_tokens, num_kv_heads, head_dim]` contiguous, K rows then V rows. A
  row is one token's K (or V) of every head; tokens `[a, b)` of a layer are
  two byte ranges, K at `a * row_bytes` and V at `(num_tokens + a) * row_bytes`.
* head-ranged (`model_kv_heads > 0`: heads `[head_start, head_start +
  num_kv_heads)` of the model's `model_kv_heads`, one decode rank's share at
  TP > 1): per layer **head-major** `[num_kv_heads, 2, num_tokens, head_dim]`,
  head i's K rows then its V rows contiguous. A row is one token's K (or V)
  of ONE head, so the heads `[s, e)` a sender (one prefill rank) owns are one
  contiguous byte range per layer, and several senders write disjoint parts
  of one landing buffer. The receiver still hands the listener
  `[2, num_tokens, num_kv_heads, head_dim]`, as a permuted (non-contiguous)
  view of the head-major bytes (`layer_view`).

A DATA frame's offset and length are whole rows in either form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# dtype name -> (torch dtype, bytes per element); the names are the wire names
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "float32": (torch.float32, 4),
    "bfloat16": (torch.bfloat16, 2),
    "float16": (torch.float16, 2),
}
DTYPE_CODES: dict[str, int] = {"float32": 1, "bfloat16": 2, "float16": 3}

MAX_LAYERS = 1024
MAX_TOKENS = 1 << 22
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096


def check_int(name: str, value: int, low: int, high: int) -> None:
    """ValueError unless `value` is an int (not a bool) in [low, high]."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one request's KV in transfer layout: all layers, context tokens
    `[token_offset, token_offset + num_tokens)`, KV heads `[head_start,
    head_start + num_kv_heads)` of the model's (module docstring for the byte
    layout of each form).

    `token_offset` > 0 is a cache-miss-only transfer: the decode pod already
    holds the first `token_offset` context tokens (whole blocks of its prefix
    cache), so row 0 of each layer is context token `token_offset`. Both ends
    must agree on it (BEGIN carries it; a mismatch is `layout_mismatch`).

    `model_kv_heads` > 0 makes the layout head-ranged (head-major bytes);
    0 is the whole model's heads in the TP=1 form, byte for byte what every
    earlier pod sends."""

    num_layers: int
    num_tokens: int
    num_kv_heads: int  # heads in this layout
    head_dim: int
    dtype: str
    token_offset: int = 0
    head_start: int = 0  # global index of the layout's first KV head
    model_kv_heads: int = 0  # the model's KV heads; 0 = whole-model (TP=1) form

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, 1, MAX_LAYERS)
        check_int("num_tokens", self.num_tokens, 1, MAX_TOKENS)
        check_int("token_offset", self.token_offset, 0, MAX_TOKENS)
        check_int("num_kv_heads", self.num_kv_heads, 1, MAX_KV_HEADS)
        check_int("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        check_int("model_kv_heads", self.model_kv_heads, 0, MAX_KV_HEADS)
        check_int("head_start", self.head_start, 0, MAX_KV_HEADS)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not self.model_kv_heads and self.head_start:
            raise ValueError(f"head_start {self.head_start} needs model_kv_heads (a "
                             "whole-model layout starts at head 0)")
        if self.model_kv_heads and self.head_start + self.num_kv_heads > self.model_kv_heads:
            raise ValueError(f"KV heads [{self.head_start}, {self.head_start + self.num_kv_heads})"
                             f" are not inside the model's {self.model_kv_heads}")

    @property
    def head_ranged(self) -> bool:
        """Head-major bytes (a TP > 1 rank's share, or several senders)."""
        return self.model_kv_heads != 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def row_bytes(self) -> int:
        """Bytes of one landing row, the unit of DATA offsets and lengths: one
        token's K (or V) of every head (num_kv_heads * head_dim * itemsize), or
        in a head-ranged layout of one head (head_dim * itemsize)."""
        heads = 1 if self.head_ranged else self.num_kv_heads
        return heads * self.head_dim * self.itemsize

    @property
    def rows_per_layer(self) -> int:
        """K rows then V rows: 2 * num_tokens (per head when head-ranged)."""
        return 2 * self.num_tokens * (self.num_kv_heads if self.head_ranged else 1)

    @property
    def bytes_per_layer(self) -> int:
        return self.rows_per_layer * self.row_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.bytes_per_layer

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """What a layer looks like to the sender's caller and the listener."""
        return (2, self.num_tokens, self.num_kv_heads, self.head_dim)

    def layer_view(self, flat: torch.Tensor) -> torch.Tensor:
        """One layer's landing bytes (`flat`, uint8, `bytes_per_layer` long) as
        `layer_shape`: contiguous in the whole-model form, a permuted view of
        the head-major bytes in a head-ranged one."""
        typed = flat.view(self.torch_dtype)
        if not self.head_ranged:
            return typed.view(self.layer_shape)
        return typed.view(self.num_kv_heads, 2, self.num_tokens, self.head_dim).permute(1, 2, 0, 3)

    def heads(self, heads: tuple[int, int] | None) -> tuple[int, int]:
        """A sender's part `[s, e)` of this layout's heads (layout-local indices;
        None = all of them), checked: ValueError unless it is inside the layout,
        and unless the layout is head-ranged when it is not all of them."""
        if heads is None:
            return 0, self.num_kv_heads
        start, end = heads
        if not 0 <= start < end <= self.num_kv_heads:
            raise ValueError(f"heads [{start}, {end}) are not inside the layout's "
                             f"[0, {self.num_kv_heads})")
        if (start, end) != (0, self.num_kv_heads) and not self.head_ranged:
            raise ValueError(f"heads [{start}, {end}) of {self.num_kv_heads}: only a "
                             "head-ranged layout (model_kv_heads > 0) splits its heads")
        return start, end

    def check_chunk(self, layer: int, kv: torch.Tensor, token_start: int,
                    heads: tuple[int, int] | None = None) -> None:  # fmt: skip
        """Raise ValueError unless `kv` is `layer`'s KV of heads `heads` (layout-local,
        None = all) for tokens from `token_start` on."""
        check_int("layer", layer, 0, self.num_layers - 1)
        start, end = self.heads(heads)
        if kv.dim() != 4 or kv.shape[0] != 2 or tuple(kv.shape[2:]) != (
            end - start,
            self.head_dim,
        ):
            raise ValueError(
                f"kv must have shape [2, n, {end - start}, {self.head_dim}], "
                f"got {list(kv.shape)}"
            )
        if kv.dtype != self.torch_dtype:
            raise ValueError(f"kv dtype must be {self.torch_dtype}, got {kv.dtype}")
        n = kv.shape[1]
        check_int("token_start", token_start, 0, self.num_tokens - 1)
        if n < 1 or token_start + n > self.num_tokens:
            raise ValueError(
                f"tokens [{token_start}, {token_start + n}) are outside [0, {self.num_tokens})"
            )

    def staged(self, kv: torch.Tensor) -> torch.Tensor:
        """`kv` [2, n, h, D] in the order its bytes are sent (`chunk_runs`' source):
        itself in the whole-model form, head-major [h, 2, n, D] (a permuted view,
        made contiguous by the stager) in a head-ranged one."""
        return kv.permute(2, 0, 1, 3) if self.head_ranged else kv

    def chunk_runs(self, token_start: int, num_tokens: int,
                   heads: tuple[int, int] | None = None) -> list[tuple[int, int, int]]:  # fmt: skip
        """Where the staged chunk of tokens [token_start, token_start + num_tokens)
        and heads `heads` (layout-local, None = all) goes in its layer, as runs
        `(first source row, first landing row, rows)`: the rows of each run are
        contiguous on both sides, and runs are as long as the layouts allow.

        Whole-model form: the chunk [2, n, H, D] is two runs (K, V), one when it
        is the whole layer. Head-ranged: the staged chunk [h, 2, n, D] is two
        runs per head (its K and V tokens), one run for all its heads when it
        holds every token (then each head's K and V rows are contiguous)."""
        start, end = self.heads(heads)
        n, total = num_tokens, self.num_tokens
        if not self.head_ranged:
            if token_start == 0 and n == total:
                return [(0, 0, 2 * n)]
            return [(0, token_start, n), (n, total + token_start, n)]
        if token_start == 0 and n == total:
            return [(0, start * 2 * total, (end - start) * 2 * n)]
        runs = []
        for i in range(end - start):
            head_row = (start + i) * 2 * total  # the head's first landing row
            runs.append((i * 2 * n, head_row + token_start, n))  # K
            runs.append((i * 2 * n + n, head_row + total + token_start, n))  # V
        return runs

    def head_bytes(self, start: int, end: int) -> tuple[int, int]:
        """Byte range [first, last) of heads [start, end) (layout-local) in one
        layer of a head-ranged layout: contiguous because it is head-major."""
        if not self.head_ranged:
            raise ValueError("only a head-ranged layout stores heads contiguously")
        start, end = self.heads((start, end))
        per_head = 2 * self.num_tokens * self.row_bytes
        return start * per_head, end * per_head

    def describe(self) -> str:
        """Every field, for a refusal naming both sides' layouts."""
        first = self.head_start
        return (f"{self.num_layers} layers x {self.num_tokens} tokens from {self.token_offset}"
                f" x KV heads [{first}, {first + self.num_kv_heads}) of "
                f"{self.model_kv_heads or self.num_kv_heads}"
                f"{'' if self.head_ranged else ' (whole model)'} x {self.head_dim} "
                f"{self.dtype}")

    def accepts(self, sent: KVLayout) -> bool:
        """A BEGIN announcing `sent` may fill a transfer expected as `self`: the
        same layout, or (self whole-model) the head-ranged form of the same heads
        -- a TP > 1 prefill pod's ranks sending to a TP=1 decode pod, whose
        landing buffer then takes the head-major bytes (`head_major`)."""
        return sent == self or (not self.head_ranged and sent == self.head_major())

    def head_share(self, head_start: int, head_end: int) -> KVLayout:
        """The head-ranged layout of global heads [head_start, head_end) of this
        whole-model layout (one decode rank's share, `RankTarget`'s range)."""
        if self.head_ranged:
            raise ValueError("head_share takes the whole-model layout")
        return KVLayout(self.num_layers, self.num_tokens, head_end - head_start, self.head_dim,
                        self.dtype, self.token_offset, head_start, self.num_kv_heads)  # fmt: skip

    def head_major(self) -> KVLayout:
        """The head-ranged form of a whole-model layout: all its heads, head-major."""
        if self.head_ranged:
            return self
        return KVLayout(self.num_layers, self.num_tokens, self.num_kv_heads, self.head_dim,
                        self.dtype, self.token_offset, 0, self.num_kv_heads)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SenderPart:
    """What one sender (one prefill rank) of a transfer writes: the
    layout-local heads [sub_start, sub_end), as one of `num_senders` senders
    that share one sending attempt (BEGIN carries it for a head-ranged layout;
    a whole-model transfer has one sender writing everything)."""

    sub_start: int
    sub_end: int
    num_senders: int = 1

    def __post_init__(self) -> None:
        check_int("num_senders", self.num_senders, 1, MAX_KV_HEADS)
        check_int("sub_start", self.sub_start, 0, MAX_KV_HEADS - 1)
        check_int("sub_end", self.sub_end, self.sub_start + 1, MAX_KV_HEADS)

    @staticmethod
    def whole(layout: KVLayout) -> SenderPart:
        """One sender writing every head of `layout`."""
        return SenderPart(0, layout.num_kv_heads, 1)

    @property
    def heads(self) -> tuple[int, int]:
        return self.sub_start, self.sub_end

    def fits(self, layout: KVLayout) -> bool:
        """Inside `layout`'s heads, and all of them unless it is head-ranged."""
        if not layout.head_ranged:
            return self == SenderPart.whole(layout)
        return self.sub_end <= layout.num_kv_heads
