"""A target from a published JAX model library: penzai's Llama-like transformer
(``penzai.models.transformer``), its layers, parameter layout and math run as they are; the
adapter (``PenzaiTarget``, the same code as docs/integration.md, "A published library's model:
penzai") supplies only the KV write through ``slot_mapping`` and the read through the
block table. ``tiny_llama`` builds a random one; ``full_recompute_greedy`` decodes with
penzai's own uncached forward (the whole sequence each step)."""

from __future__ import annotations

import numpy as np

# --- the adapter: docs/integration.md's block, verbatim (tests/engine/test_library_target.py) ---
import dataclasses

import jax
import jax.numpy as jnp
from penzai import pz
from penzai.models.transformer.model_parts import TransformerBlock


@pz.pytree_dataclass
class PagedAttention(pz.nn.Layer):
    """penzai's ``pz.nn.Attention`` sublayers as they are; K and V through specjax's pages."""
    attn: pz.nn.Attention
    layer: int = dataclasses.field(metadata={"pytree_node": False})

    def __call__(self, x, **side):
        a, pg = self.attn, side["pages"]
        q, k, v = (f(x, **side) for f in (a.input_to_query, a.input_to_key, a.input_to_value))
        axes = [n for n in k.named_shape if n != "seq"]                 # kv heads, projection
        kc, vc = (c.at[pg["write"]].set(t.unwrap("seq", *axes).astype(c.dtype), mode="drop")
                  for c, t in zip(pg["kv"][self.layer].value, (k, v)))
        pg["kv"][self.layer].value = (kc, vc)
        ctx = lambda c: pz.nx.wrap(c[pg["read"]].astype(q.dtype)).tag("tok", "seq", *axes)  # noqa
        one = lambda t: t.untag("seq").tag("tok")[{"seq": None}]  # noqa: E731 (a query per token)
        s = dict(side, token_positions=one(side["token_positions"]), kv_positions=pg["ctx_pos"])
        probs = a.query_key_to_attn((one(q), ctx(kc)), **s)
        return a.attn_value_to_output((probs, ctx(vc)), **s)[{"seq": 0}].untag("tok").tag("seq")


@dataclasses.dataclass(frozen=True)
class PenzaiTarget:
    """A ``specjax.Target`` over a penzai ``TransformerLM``; params: its parameters by label."""
    model: pz.nn.Layer = dataclasses.field(compare=False, repr=False)
    model_id: int = 0                                # equal and hashed by the model's identity
    aux_layer_ids: tuple[int, ...] = ()
    recurrent: bool = False
    vocab_size = property(lambda self: self.model.metadata.vocab_size)
    hidden_size = property(lambda self: self.model.metadata.embedding_dim)
    num_layers = property(
        lambda self: pz.select(self.model).at_instances_of(PagedAttention).count())

    @classmethod
    def from_penzai(cls, lm):
        """``(target, params)``: attention paged, masks reading the context's positions."""
        masks = pz.nn.ApplyCausalAttentionMask | pz.nn.ApplyCausalSlidingWindowAttentionMask
        lm = pz.select(lm).at_instances_of(masks).apply(
            lambda m: dataclasses.replace(m, kv_positions_input_name="kv_positions"))
        sel = pz.select(lm).at_instances_of(pz.nn.Attention)
        lm = sel.set_sequence(PagedAttention(a, i) for i, a in enumerate(sel.get_sequence()))
        model, params = pz.unbind_params(lm, freeze=True)
        return cls(model, id(model)), {p.label: p for p in params}   # a dict: make_proposer's

    def with_aux_layers(self, ids):
        return dataclasses.replace(self, aux_layer_ids=tuple(int(i) for i in ids))

    def init_kv_caches(self, num_blocks, block_size, dtype):   # per layer (K, V) [blocks, bs, ...]
        m = self.model.metadata
        shape = (num_blocks, block_size, *m.common_head_axes.values(), m.projection_dim)
        return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                     for _ in range(self.num_layers))

    def kv_bytes_per_block(self, block_size, dtype):
        return sum(a.nbytes for a in jax.tree.leaves(self.init_kv_caches(1, block_size, dtype)))

    def shared_weights(self, params):                 # untied: "lm_head"; tied: the embedder's
        w = {label.rsplit("/", 1)[-1]: p.value for label, p in params.items()}
        emb = w["embedder.embeddings"].unwrap("vocabulary", "embedding")
        head = {"kernel": w["lm_head.weights"].unwrap("embedding", "vocabulary")} \
            if "lm_head.weights" in w else {"embedding": emb}
        return {"embed_tokens": {"embedding": emb}, "lm_head": head}

    def _layers(self, params):         # penzai's own layers: up to the final norm, and the rest
        body = pz.bind_variables(self.model, params.values()).body.sublayers
        cut = 2 + max(i for i, b in enumerate(body) if isinstance(b, TransformerBlock))
        return body[:cut], body[cut:]

    def compute_logits(self, params, hidden):
        h = pz.nx.wrap(hidden).tag("seq", "embedding")
        for layer in self._layers(params)[1]:
            h = layer(h)
        return h.unwrap("seq", "vocabulary").astype(jnp.float32)

    def forward(self, params, input_ids, positions, kv, attn):
        (nb, bs), bt, sm = kv[0][0].shape[:2], attn.block_table, attn.slot_mapping
        req = jnp.clip(jnp.searchsorted(attn.query_start_loc, jnp.arange(input_ids.shape[0]),
                                        side="right") - 1, 0, bt.shape[0] - 1)
        ctx = jnp.arange(bt.shape[1] * bs)                    # every context position of a row
        pages = {"kv": [pz.StateVariable(value=c) for c in kv],
                 "write": (jnp.where(sm < 0, nb, sm // bs), sm % bs),   # -1: out of range, dropped
                 "read": (bt[req][:, ctx // bs], ctx % bs),             # [T, C]
                 "ctx_pos": pz.nx.wrap(ctx).tag("seq")}   # causal: position < seq_lens[req]
        h, aux, block = pz.nx.wrap(input_ids).tag("seq"), [], 0
        for layer in self._layers(params)[0]:
            if isinstance(layer, TransformerBlock):
                aux += [h.unwrap("seq", "embedding")] if block in self.aux_layer_ids else []
                block += 1
            h = layer(h, pages=pages, token_positions=pz.nx.wrap(positions).tag("seq"))
        return (h.unwrap("seq", "embedding"), jnp.stack(aux, 1) if aux else None,
                tuple(c.value for c in pages["kv"]))


# --- end of the adapter ---


def tiny_llama(seed: int = 0, *, vocab: int = 97, hidden: int = 64, layers: int = 2):
    """A random penzai Llama-like model (grouped-query attention: 2 KV groups of 2 heads)."""
    from penzai.models.transformer.variants import llamalike_common as ll

    cfg = ll.LlamalikeTransformerConfig(
        num_kv_heads=2, query_head_multiplier=2, embedding_dim=hidden, projection_dim=hidden // 4,
        mlp_hidden_dim=2 * hidden, num_decoder_blocks=layers, vocab_size=vocab,
        mlp_variant="swiglu", tie_embedder_and_logits=False)
    return ll.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(seed))


def tiny_gemma(seed: int = 0, *, vocab: int = 97, hidden: int = 64, layers: int = 2):
    """A random penzai Gemma-2-like model: multi-query attention, tied embedder, sliding-window
    and global layers alternating, soft caps, post-norms, GeGLU."""
    from penzai.models.transformer.variants import llamalike_common as ll

    cfg = ll.LlamalikeTransformerConfig(
        num_kv_heads=1, query_head_multiplier=4, embedding_dim=hidden, projection_dim=hidden // 4,
        mlp_hidden_dim=2 * hidden, num_decoder_blocks=layers, vocab_size=vocab,
        mlp_variant="geglu_approx", tie_embedder_and_logits=True,
        attention_type=(ll.AttentionTypeSlidingWindowCausal(2), ll.AttentionTypeGlobalCausal()),
        use_post_attn_norm=True, use_post_ffw_norm=True, final_logit_softcap=30.0,
        attn_logits_soft_cap=50.0, query_scaling_factor=0.2)
    return ll.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(seed))


def full_recompute_greedy(lm, prompt, n: int, *, length: int = 64) -> tuple[list[int], float]:
    """``n`` greedy tokens after ``prompt`` from penzai's own forward (``lm(tokens)``, no cache),
    the whole sequence recomputed for each (right-padded to ``length``: one compile; causal, so
    the padding changes nothing before it), and the smallest gap between the top two logits
    along the way (a near-tie would be flaky)."""
    frozen = pz.freeze_params(lm)
    logits = jax.jit(lambda m, t: m(pz.nx.wrap(t).tag("seq")).unwrap("seq", "vocabulary"))
    seq, margin = [int(t) for t in prompt], np.inf
    for _ in range(n):
        assert len(seq) <= length
        last = np.asarray(logits(frozen, jnp.asarray(seq + [0] * (length - len(seq)), jnp.int32)))
        last = last[len(seq) - 1]
        top2 = np.sort(last)[-2:]
        margin = min(margin, float(top2[1] - top2[0]))
        seq.append(int(np.argmax(last)))
    return seq[len(prompt):], margin
