"""The decoder skeleton every architecture shares: embed → layers → final norm → logits.

An architecture module supplies the layer class and how to read its config; this module owns the
single forward entry point over a flat batch (`forward(batch, kv_cache)`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from polylane.runtime.kv.kv_cache import PagedKVCache
from polylane.runtime.model.batch import ForwardBatch
from polylane.runtime.model.layers import ForwardContext, Projection, RMSNorm, RotaryTable, linear
from polylane.runtime.model.model_config import GLOBAL, SLIDING, ModelConfig


class ForwardBackend(Protocol):
    """The layer stack run outside torch (the native stack, `runtime/model/native/stack.py`), chosen at load
    by `runtime/loading/loaded_model.py`: the model class calls it without knowing what it is."""

    def forward(
        self,
        model: DecoderModel,
        batch: ForwardBatch,
        cache: PagedKVCache,
        start_layer: int = 0,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The batch's logits with its K/V written, or None where the backend does not take it."""
        ...

    def split(self, batch: ForwardBatch) -> tuple[list[int], list[int]] | None:
        """(chunks for the backend, chunks for torch) of a batch `forward` did not take, or None."""
        ...


class DecoderModel(nn.Module):
    """A causal decoder over paged KV. Subclasses set `layer_class` and `gemma_norms`."""

    layer_class: type[nn.Module]
    gemma_norms: bool = False  # norms multiply in float32 and keep float32 weights

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, index) for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, cast_before_weight=not self.gemma_norms)
        self.lm_head = None if config.tie_embeddings else Projection(config.hidden_size, config.vocab_size)
        # Tied float32 embeddings are kept once, (hidden, vocab), the fast layout for the
        # output projection; token lookup then reads columns (see `prepare`).
        self.vocab_columns: nn.Parameter | None = None
        self.weight_dtype = torch.float32
        self._rotary: dict[str, RotaryTable] = {}
        # the whole stack in one C call where the model allows it, set at load (runtime/model/native)
        self.native_stack: ForwardBackend | None = None

    def choose_layouts(self, dtype: torch.dtype) -> set[str]:
        """Decide run-time weight layouts before loading (on the meta device).

        float32: widening projections store their weight (in, out) (see `Projection`), and tied
        embeddings are kept once as `vocab_columns` (hidden, vocab), the fast layout for the
        output projection; token lookup then reads columns. Returns the names of the parameters
        stored transposed, which the loader fills column-wise.
        """
        self.weight_dtype = dtype
        transposed: set[str] = set()
        if dtype != torch.float32:
            return transposed
        for name, module in self.named_modules():
            if isinstance(module, Projection) and module.prefers_input_major:
                module.use_input_major_layout()
                transposed.add(f"{name}.weight")
        if self.lm_head is None:
            shape = (self.config.hidden_size, self.config.vocab_size)
            self.vocab_columns = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
            self.embed_tokens = None
            transposed.add("vocab_columns")
        return transposed

    def prepare(self) -> None:
        """Build the RoPE tables (after loading)."""
        config, device = self.config, self.norm.weight.device
        self._rotary = {GLOBAL: RotaryTable(config.head_dim, config.rope_theta, device)}
        if config.has_sliding_layers:
            local_theta = config.rope_local_theta or config.rope_theta
            self._rotary[SLIDING] = RotaryTable(config.head_dim, local_theta, device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_columns is not None:
            return self.vocab_columns.index_select(1, token_ids).t()  # (T, E)
        return self.embed_tokens(token_ids)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.vocab_columns is not None:
            return linear(hidden, self.vocab_columns, None, input_major=True)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return linear(hidden, self.embed_tokens.weight, None, input_major=False)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv_cache: PagedKVCache,
        *,
        start_layer: int = 0,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the batch's new tokens, write their K/V, return float32 logits (R, vocab).

        With `start_layer` > 0, `hidden` (T, E) is that layer's input and only the layers from it
        run: a shared band's boundary state, the K/V below written by the caller (see
        `ModelKV.extend_from_band`). The input of every layer the cache records boundary states
        for (`PagedKVCache.add_boundary`) is stored on the way, the final one included.
        """
        if start_layer and hidden is None:
            raise ValueError("starting above layer 0 needs that layer's input hidden state")
        if self.native_stack is not None:
            logits = self.native_stack.forward(self, batch, kv_cache, start_layer, hidden)
            if logits is not None:
                return logits
            split = self.native_stack.split(batch)
            if split is not None:
                return self._forward_split(batch, kv_cache, split, start_layer, hidden)
        return self._torch_forward(batch, kv_cache, start_layer, hidden)

    def _forward_split(
        self,
        batch: ForwardBatch,
        kv_cache: PagedKVCache,
        split: tuple[list[int], list[int]],
        start_layer: int,
        hidden: torch.Tensor | None,
    ) -> torch.Tensor:
        """The batch's chunks in two forwards, the native stack's and torch's (`NativeStack.split`),
        their logits put back in the batch's row order."""
        assert self.native_stack is not None
        native_chunks, torch_chunks = split
        logits: torch.Tensor | None = None
        for chunks, native in ((native_chunks, True), (torch_chunks, False)):
            part, token_rows, logit_rows = batch.select(chunks)
            part_hidden = None if hidden is None else hidden[token_rows]
            part_logits = None
            if native:
                part_logits = self.native_stack.forward(self, part, kv_cache, start_layer, part_hidden)
            if part_logits is None:
                part_logits = self._torch_forward(part, kv_cache, start_layer, part_hidden)
            if logits is None:
                logits = part_logits.new_empty(batch.logit_rows.shape[0], part_logits.shape[1])
            logits[logit_rows] = part_logits
        assert logits is not None
        return logits

    def _torch_forward(
        self, batch: ForwardBatch, kv_cache: PagedKVCache, start_layer: int, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        if hidden is None:
            hidden = self.embed(batch.token_ids)  # (T, E)
            if self.config.embedding_scale != 1.0:
                hidden = hidden * torch.tensor(self.config.embedding_scale, dtype=hidden.dtype)
        bound = batch.longest_context
        rotary = {kind: table.lookup(batch.positions, bound) for kind, table in self._rotary.items()}
        context = ForwardContext(batch, kv_cache, rotary)
        for index in range(start_layer, len(self.layers)):
            if index in kv_cache.boundary_states:
                kv_cache.write_boundary(index, batch.slot_mapping, hidden)
            hidden = self.layers[index](hidden, context)
        if len(self.layers) in kv_cache.boundary_states:
            kv_cache.write_boundary(len(self.layers), batch.slot_mapping, hidden)
        hidden = self.norm(hidden[batch.logit_rows])  # (R, E)
        logits = self.output_logits(hidden).float()  # (R, V)
        if self.config.final_logit_softcap:
            cap = self.config.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
