"""What kiln's GPT keeps for its backward pass, tensor by tensor, for ``kiln plan``.

Counted from what autograd saves in kiln's block (pre-norm RMSNorm, q/k/v with RoPE, SDPA,
SwiGLU MLP) and in its fused output layer + loss; the figures were checked against live-tensor
measurements of real training steps (tests/plan/test_plan.py).
"""

from __future__ import annotations

from kiln.models.family import HeadMemory, MemoryContext, MemoryModel
from kiln.models.fused_loss import default_chunk_size
from kiln.models.gpt.model import GPTConfig


class GPTMemory(MemoryModel):
    buffers = "RoPE tables"
    # At the MLP product's backward, the gradients of w1 x, w3 x and the product are alive at
    # once, next to the block's activations and w2's new gradient.
    backward_peak_grad = "mlp.w2"
    counts_compiled = True

    def __init__(self, cfg: GPTConfig):
        self.cfg = cfg
        self.n_layer, self.d_model, self.vocab_size = cfg.n_layer, cfg.d_model, cfg.vocab_size
        # What the plan's time model moves: the keys' (and values') width, which context
        # parallelism gathers, and the copies of a token that expert parallelism sends.
        self.kv_width, self.experts_per_token = cfg.n_kv_head * cfg.head_dim, cfg.experts_per_token

    def block_activations(self, ctx: MemoryContext) -> int:
        """Per tensor autograd saves (checked against saved-tensor hooks on CPU): the block's
        input and the residual after attention; per RMSNorm, x / rms in fp32 (for its gain's
        gradient) and 1 / rms; the normed input of each projection (under autocast each of the
        five casts it separately); rotated q, k (repeated to every head under GQA), v, SDPA's
        output and log-sum-exp, and the [B, T, heads * head_dim] copy of the output that wo
        reads; the SwiGLU MLP's w1 x, w3 x, silu(w1 x) and their product. Heads and d_ff are
        divided among tensor-parallel ranks.

        Compiled, Inductor's graph keeps the block's input and the residual after attention, each
        norm's output once (the norms' statistics are recomputed), q, k and v as projected (keys
        and values not repeated), SDPA's output and log-sum-exp, and the MLP's tensors. Against
        compiled bf16 runs on an H200 (gpt2-124m at micro-batches 8, 32 and 64, 1b at 32): 8-14%
        above their peaks (BENCHMARKS.md, seventh lease), where the eager count was 35-44% above."""
        cfg, act = self.cfg, ctx.act_bytes
        d = cfg.d_model
        heads = cfg.n_head // ctx.tp
        width = heads * cfg.head_dim  # q, and k and v once repeated to every head
        # Under sequence parallelism the residual stream and the norms hold a rank's positions;
        # the projections' inputs are gathered whole.
        split = ctx.tp if ctx.sequence_parallel else 1
        if ctx.compiled:
            kv = cfg.n_kv_head // ctx.tp * cfg.head_dim
            per_token = (2 * ctx.residual_bytes * d + 2 * act * d) // split + act * (2 * width + 2 * kv) + 4 * heads
        else:
            per_token = (2 * ctx.residual_bytes * d + 2 * (4 * d + 4)) // split + (5 if ctx.autocast else 2) * act * d
            per_token += act * 3 * width + 4 * heads
        per_token += self._mlp(ctx)
        # Under context parallelism SDPA keeps the keys and values of the whole sequences,
        # gathered from the group (kiln.distributed.context): one copy, repeated to every head
        # once, which the rank's head and tail chunks' calls share.
        return ctx.tokens * (per_token + 2 * act * width * ctx.cp)

    def _mlp(self, ctx: MemoryContext) -> int:
        """Bytes a token's MLP keeps. A mixture of experts (the blocks are counted as their
        largest kind) keeps the router's fp32 logits and scores, each of the token's k copies as
        its experts read it and their SwiGLU tensors and outputs, its weights and sort order, and
        the shared experts' SwiGLU tensors."""
        cfg, act = self.cfg, ctx.act_bytes
        if not cfg.n_experts:
            # SwiGLU: w1 x, w3 x, silu(w1 x), the product; relu2: relu(w1 x) and its square.
            return act * (4 if cfg.mlp == "swiglu" else 2) * (cfg.d_ff // ctx.tp)
        k, shared = cfg.experts_per_token, cfg.n_shared_experts * cfg.d_expert
        return 8 * cfg.n_experts + k * (act * (2 * cfg.d_model + 4 * cfg.d_expert) + 4 + 16) + act * 4 * shared

    def block_backward_workspace(self, ctx: MemoryContext) -> int:
        """The residual stream's fp32 gradient, and two [tokens, d_ff] gradients of the MLP."""
        return 4 * ctx.tokens * self.d_model + 2 * ctx.act_bytes * ctx.tokens * (self.cfg.d_ff // ctx.tp)

    def after_blocks(self, ctx: MemoryContext) -> int:
        """The final RMSNorm keeps its input (the last block's output), x / rms and 1 / rms (a
        rank's positions under sequence parallelism)."""
        split = ctx.tp if ctx.sequence_parallel else 1
        return ctx.tokens * (ctx.residual_bytes * self.d_model + 4 * self.d_model + 4) // split

    def head(self, ctx: MemoryContext) -> HeadMemory:
        """kiln's fused output projection + cross-entropy (models/fused_loss.py): what it keeps
        from forward to backward (the fp32 gradients of the hidden states and of the output
        weight), and its largest transient during forward: the final norm's output, and a
        chunk's [chunk, vocab] fp32 logits, which become that chunk's gradient. The next chunk's
        logits are made while the previous chunk's gradient is still held; under autocast they
        come from low-precision logits, and the gradient is cast down again for the two matmuls
        that use it. Its backward only scales copies of the two saved gradients. Compiled, a
        chunk's softmax and gradient are fused: one chunk's fp32 logits and their 16-bit copy
        at a time."""
        # Under loss parallelism each rank computes its share of the vocabulary.
        tokens, d = ctx.tokens, self.d_model
        vocab = self._vocab(ctx)
        saved = 4 * tokens * d + 4 * vocab * d
        chunk = min(default_chunk_size(vocab, ctx.device), tokens)
        held = 4 * chunk * vocab if tokens > chunk else 0
        low = 2 if ctx.autocast else 0
        making_logits = held + (4 + low) * chunk * vocab + low * chunk * d
        using_gradient = (4 + low) * chunk * vocab + (low or 4) * chunk * d + low * vocab * d
        transient = (4 + low) * chunk * vocab if ctx.compiled else max(making_logits, using_gradient)
        return HeadMemory(saved, 4 * tokens * (d + 1) + transient, 2 * saved)

    def _vocab(self, ctx: MemoryContext) -> int:
        """The rows of the embedding and output layer a rank holds (split by vocabulary under
        sequence and loss parallelism)."""
        return self.vocab_size // ctx.tp if ctx.sequence_parallel else self.vocab_size

    def head_weight_copy(self, ctx: MemoryContext) -> int:
        return 2 * self._vocab(ctx) * self.d_model if ctx.casts_weights else 0

    def embedding_backward(self, ctx: MemoryContext, accumulating: bool) -> int:
        """The embedding's gradient is a new dense tensor. Tied to the output layer, autograd adds
        the two gradients out of place before storing the sum; earlier micro-batches' one is
        added to in place."""
        copies = 2 if self.cfg.tie_embeddings else 1 if accumulating else 0
        return 4 * ctx.tokens * self.d_model + 4 * self._vocab(ctx) * self.d_model * copies
