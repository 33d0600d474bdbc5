"""(No tests here: helpers for test_converters.py.)

Tiny checkpoints in every upstream layout, built from NumPy alone (no torch), for the
converter tests. Key names and shapes follow research/checkpoint_formats.md, written out
here independently of specjax.converters.

``write_torch_zip`` writes a ``torch.save`` zip archive by hand, following torch's
serialization layout: ``<prefix>/data.pkl`` (protocol 2; storages as persistent ids
``('storage', torch.<T>Storage, key, 'cpu', numel)``, tensors as
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())``),
``<prefix>/data/<key>`` (raw little-endian bytes), ``<prefix>/version``,
``<prefix>/byteorder``, ``<prefix>/.data/version``.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import pickle
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

H, NH, NKV, HD, I, V, VD = 16, 4, 2, 4, 24, 48, 32
R = 6  # DSpark markov_rank
STORAGE_TYPES = {
    np.dtype(np.float32): "FloatStorage", np.dtype(np.float16): "HalfStorage",
    np.dtype(ml_dtypes.bfloat16): "BFloat16Storage", np.dtype(np.int64): "LongStorage",
    np.dtype(np.int32): "IntStorage", np.dtype(np.bool_): "BoolStorage",
    np.dtype(np.float64): "DoubleStorage",
}


# -- a torch.save writer without torch -----------------------------------------------------

class Global:
    """A pickled reference to ``module.name`` (emitted as a GLOBAL opcode)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *a):  # pickle checks that a reduce function is callable
        raise AssertionError("never called")


class Call:
    """Pickles as ``module.name(*args)`` (GLOBAL + args + REDUCE)."""

    def __init__(self, fn: Global, args: tuple):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@dataclasses.dataclass(eq=False)
class Storage:
    key: str
    data: np.ndarray  # 1-D

    def pid(self):
        return ("storage", Global("torch", STORAGE_TYPES[self.data.dtype]), self.key, "cpu",
                int(self.data.size))


@dataclasses.dataclass
class View:
    """A tensor view of ``storage``: element offset, size, stride (torch semantics)."""

    storage: Storage
    offset: int
    size: tuple
    stride: tuple

    def array(self) -> np.ndarray:
        it = self.storage.data.itemsize
        return np.lib.stride_tricks.as_strided(
            self.storage.data[self.offset:], self.size, [s * it for s in self.stride]).copy()


def rebuild(view: View) -> Call:
    return Call(Global("torch._utils", "_rebuild_tensor_v2"),
                (view.storage, view.offset, tuple(view.size), tuple(view.stride), False,
                 Call(Global("collections", "OrderedDict"), ())))


class _TorchPickler(pickle._Pickler):  # the pure-Python pickler, so save() can be extended
    def persistent_id(self, obj):
        return obj.pid() if isinstance(obj, Storage) else None

    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, Global):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            return
        super().save(obj, save_persistent_id)


def contiguous_view(arr: np.ndarray, key: str) -> View:
    arr = np.ascontiguousarray(arr)
    strides = tuple(s // arr.itemsize for s in arr.strides) if arr.ndim else ()
    return View(Storage(key, arr.reshape(-1)), 0, arr.shape, strides)


def torch_zip_bytes(obj, storages: list[Storage], prefix: str = "archive") -> bytes:
    buf = io.BytesIO()
    _TorchPickler(buf, protocol=2).dump(obj)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{prefix}/data.pkl", buf.getvalue())
        zf.writestr(f"{prefix}/byteorder", "little")
        for st in storages:
            zf.writestr(f"{prefix}/data/{st.key}", st.data.astype(st.data.dtype.newbyteorder("<"))
                        .tobytes())
        zf.writestr(f"{prefix}/version", "3\n")
        zf.writestr(f"{prefix}/.data/version", "3\n")
    return out.getvalue()


def write_torch_zip(path, tensors: dict, prefix: str | None = None) -> None:
    """``torch.save(state_dict, path)`` without torch. Values are arrays or :class:`View`."""
    path = Path(path)
    sd, storages, seen = collections.OrderedDict(), [], {}
    for i, (k, v) in enumerate(tensors.items()):
        view = v if isinstance(v, View) else contiguous_view(np.asarray(v), str(i))
        if id(view.storage) not in seen:
            seen[id(view.storage)] = view.storage
            storages.append(view.storage)
        sd[k] = rebuild(view)
    # nn.Module.state_dict() carries a _metadata attribute (pickled through BUILD).
    sd._metadata = collections.OrderedDict({"": {"version": 1}})
    path.write_bytes(torch_zip_bytes(sd, storages, prefix or path.stem))


def malicious_pickle_zip(path, command: str) -> None:
    """A torch-layout archive whose pickle calls ``os.system(command)`` when loaded."""
    payload = (b"\x80\x02" + b"cos\nsystem\n" + pickle.BINUNICODE
               + len(command.encode()).to_bytes(4, "little") + command.encode()
               + b"\x85R.")  # TUPLE1, REDUCE, STOP
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", payload)
        zf.writestr("archive/version", "3\n")


# -- key tables (research/checkpoint_formats.md) ------------------------------------------

def decoder_layer(prefix: str, *, width: int = H, hd: int = HD, input_norm: bool = True,
                  qkv_bias: bool = False, qk_norm: bool = False,
                  hidden_norm: bool = False) -> dict:
    t = {
        f"{prefix}self_attn.q_proj.weight": (NH * hd, width),
        f"{prefix}self_attn.k_proj.weight": (NKV * hd, width),
        f"{prefix}self_attn.v_proj.weight": (NKV * hd, width),
        f"{prefix}self_attn.o_proj.weight": (H, NH * hd),
        f"{prefix}mlp.gate_proj.weight": (I, H),
        f"{prefix}mlp.up_proj.weight": (I, H),
        f"{prefix}mlp.down_proj.weight": (H, I),
        f"{prefix}post_attention_layernorm.weight": (H,),
    }
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = (H,)
    if hidden_norm:
        t[f"{prefix}hidden_norm.weight"] = (H,)
    if qkv_bias:
        t[f"{prefix}self_attn.q_proj.bias"] = (NH * hd,)
        t[f"{prefix}self_attn.k_proj.bias"] = (NKV * hd,)
        t[f"{prefix}self_attn.v_proj.bias"] = (NKV * hd,)
    if qk_norm:
        t[f"{prefix}self_attn.q_norm.weight"] = (hd,)
        t[f"{prefix}self_attn.k_norm.weight"] = (hd,)
    return t


def mtp_module(prefix: str) -> dict:
    """One MiMo MTP module (research/vllm_delta_0.33.md section 1.2): its own norms and
    ``input_proj`` [H, 2H] plus a Qwen2 decoder block (q/k/v bias)."""
    t = {f"{prefix}token_layernorm.weight": (H,), f"{prefix}hidden_layernorm.weight": (H,),
         f"{prefix}input_proj.weight": (H, 2 * H), f"{prefix}final_layernorm.weight": (H,)}
    t.update(decoder_layer(prefix, qkv_bias=True))
    return t


def mtp_canonical(key: str, module: str = "model.mtp_layers.0.") -> str | None:
    """The canonical ``mtp`` name of a module-0 key (None for any other key)."""
    if not key.startswith(module):
        return None
    name = key[len(module):]
    own = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")
    return name if name.startswith(own) else "layers.0." + name


def llama_config(**kw) -> dict:
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H,
               intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV,
               num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=V,
               max_position_embeddings=256, tie_word_embeddings=False, torch_dtype="float32",
               hidden_act="silu")
    cfg.update(kw)
    return cfg


@dataclasses.dataclass
class Case:
    """One checkpoint: ``config`` (None: no config.json), ``shapes`` (on-disk key -> shape
    or (shape, dtype)), ``fmt`` (expected detection), ``kind``, ``canonical`` (on-disk key
    -> canonical key, None: dropped), ``layout`` (how to write it)."""

    name: str
    fmt: str
    kind: str
    config: dict | None
    shapes: dict
    canonical: dict
    layout: str = "safetensors"
    dtype: object = np.float32
    hf_checks: dict = dataclasses.field(default_factory=dict)

    def arrays(self, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        out = {}
        for k, spec in self.shapes.items():
            shape, dtype = spec if isinstance(spec[0], tuple) else (spec, self.dtype)
            dtype = np.dtype(dtype)
            if k == "d2t":
                out[k] = (rng.integers(0, V - VD, size=shape)).astype(dtype)
            elif k == "token_map":
                out[k] = np.sort(rng.choice(V, size=shape, replace=False)).astype(dtype)
            elif dtype == np.bool_:
                out[k] = rng.random(shape) < 0.5
            else:
                out[k] = rng.standard_normal(shape).astype(np.float32).astype(dtype)
        return out

    def write(self, root: Path, seed: int = 0) -> tuple[Path, dict[str, np.ndarray]]:
        d = root / self.name
        d.mkdir(parents=True)
        if self.config is not None:
            (d / "config.json").write_text(json.dumps(self.config))
        arrays = self.arrays(seed)
        write_layout(d, arrays, self.layout)
        return d, arrays


def write_layout(d: Path, arrays: dict, layout: str) -> None:
    keys = list(arrays)
    if layout == "safetensors":
        save_file(arrays, str(d / "model.safetensors"))
    elif layout == "safetensors-sharded":
        half = len(keys) // 2
        shards = {"model-00001-of-00002.safetensors": keys[:half],
                  "model-00002-of-00002.safetensors": keys[half:]}
        for fname, ks in shards.items():
            save_file({k: arrays[k] for k in ks}, str(d / fname))
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    elif layout == "bin":
        write_torch_zip(d / "pytorch_model.bin", arrays)
    elif layout == "bin-sharded":
        half = len(keys) // 2
        shards = {"pytorch_model-00001-of-00002.bin": keys[:half],
                  "pytorch_model-00002-of-00002.bin": keys[half:]}
        for fname, ks in shards.items():
            write_torch_zip(d / fname, {k: arrays[k] for k in ks})
        (d / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    elif layout == "medusa-pt":
        write_torch_zip(d / "medusa_lm_head.pt", arrays)
    else:
        raise ValueError(layout)


def _identity(shapes: dict, drop=()) -> dict:
    return {k: (None if k in drop else k) for k in shapes}


def cases() -> list[Case]:
    out = []
    # HF Llama: sharded safetensors, untied, an old rotary_emb.inv_freq buffer.
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
              "lm_head.weight": (V, H),
              "model.layers.0.self_attn.rotary_emb.inv_freq": (HD // 2,)}
    for i in range(2):
        shapes.update(decoder_layer(f"model.layers.{i}."))
    out.append(Case("llama", "llama", "llama", llama_config(), shapes,
                    _identity(shapes, drop=["model.layers.0.self_attn.rotary_emb.inv_freq"]),
                    layout="safetensors-sharded",
                    hf_checks={"rope_theta": 500000.0, "head_dim": HD,
                               "tie_word_embeddings": False}))
    # HF Qwen2: tied (lm_head.weight stored anyway: dropped), q/k/v bias, sharded .bin.
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
              "lm_head.weight": (V, H)}
    for i in range(2):
        shapes.update(decoder_layer(f"model.layers.{i}.", qkv_bias=True))
    cfg = llama_config(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                       tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)
    out.append(Case("qwen2", "qwen2", "qwen2", cfg, shapes,
                    _identity(shapes, drop=["lm_head.weight"]), layout="bin-sharded",
                    hf_checks={"attention_bias": True, "tie_word_embeddings": True}))
    # HF Qwen3: head_dim 8 != H/nH, q/k norms, transformers-v5 rope_parameters, bf16.
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
              "lm_head.weight": (V, H)}
    for i in range(2):
        shapes.update(decoder_layer(f"model.layers.{i}.", hd=8, qk_norm=True))
    cfg = llama_config(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=8,
                       rope_theta=None, rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1e6},
                       dtype="bfloat16")
    cfg.pop("rope_theta")
    cfg.pop("torch_dtype")
    out.append(Case("qwen3", "qwen3", "qwen3", cfg, shapes, _identity(shapes),
                    dtype=ml_dtypes.bfloat16,
                    hf_checks={"rope_theta": 1e6, "head_dim": 8, "rope_scaling": None}))
    # HF Mistral: a window on every layer, head_dim 8 != H/nH; Ministral: per-layer windows.
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
              "lm_head.weight": (V, H)}
    for i in range(2):
        shapes.update(decoder_layer(f"model.layers.{i}.", hd=8))
    cfg = llama_config(architectures=["MistralForCausalLM"], model_type="mistral", head_dim=8,
                       sliding_window=6, rope_theta=1e8)
    out.append(Case("mistral", "mistral", "mistral", cfg, shapes, _identity(shapes),
                    hf_checks={"sliding_window": 6, "head_dim": 8}))
    cfg = llama_config(architectures=["MinistralForCausalLM"], model_type="ministral",
                       head_dim=8, sliding_window=6,
                       layer_types=["sliding_attention", "full_attention"])
    out.append(Case("ministral", "ministral", "ministral", cfg, shapes, _identity(shapes),
                    hf_checks={"sliding_window": 6,
                               "layer_types": ["sliding_attention", "full_attention"]}))
    # HF Gemma 3 text: sandwich norms, q/k norms, tied, transformers-4 keys (pattern 2).
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(2):
        shapes.update(decoder_layer(f"model.layers.{i}.", hd=8, qk_norm=True))
        shapes.update({f"model.layers.{i}.{n}.weight": (H,)
                       for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")})
    gemma = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=8,
                 hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=8,
                 sliding_window=6, sliding_window_pattern=2, rope_theta=1e6,
                 rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                 final_logit_softcapping=None, attn_logit_softcapping=None,
                 tie_word_embeddings=True)
    cfg = llama_config(**gemma)
    cfg.pop("hidden_act")
    out.append(Case("gemma3", "gemma3", "gemma3", cfg, shapes, _identity(shapes),
                    hf_checks={"sliding_window": 6, "model_type": "gemma3_text"}))
    # Gemma3ForConditionalGeneration, transformers 5: model.language_model.*, a vision tower
    # (dropped), text_config with rope_parameters per layer type.
    text = {k: v for k, v in cfg.items() if k not in (
        "architectures", "rope_theta", "rope_local_base_freq", "rope_scaling", "torch_dtype",
        "sliding_window_pattern")}
    text.update(layer_types=["sliding_attention", "full_attention"], rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    cg = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3",
              text_config=text, vision_config={"model_type": "siglip_vision_model"},
              torch_dtype="float32")
    cg_shapes = {"model.language_model." + k[len("model."):]: v for k, v in shapes.items()}
    cg_shapes.update({"model.vision_tower.vision_model.post_layernorm.weight": (8,),
                      "model.multi_modal_projector.mm_input_projection_weight": (8, H),
                      "lm_head.weight": (V, H)})
    canon = {k: ("model." + k[len("model.language_model."):]
                 if k.startswith("model.language_model.") else None) for k in cg_shapes}
    out.append(Case("gemma3_cg", "gemma3", "gemma3", cg, cg_shapes, canon,
                    hf_checks={"model_type": "gemma3_text", "num_hidden_layers": 2}))
    # HF Qwen3-MoE, transformers 5's stacked experts (the canonical form; the Hub's
    # per-expert layout is read in tests/models/test_moe.py): layer 0 sparse (router, 4
    # SwiGLU experts of width 16), layer 1 dense (mlp_only_layers).
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
              "lm_head.weight": (V, H)}
    for i in range(2):
        shapes.update(decoder_layer(f"model.layers.{i}.", hd=8, qk_norm=True))
    shapes = {k: v for k, v in shapes.items() if not k.startswith("model.layers.0.mlp.")}
    shapes["model.layers.0.mlp.gate.weight"] = (4, H)
    shapes["model.layers.0.mlp.experts.gate_up_proj"] = (4, 32, H)
    shapes["model.layers.0.mlp.experts.down_proj"] = (4, H, 16)
    cfg = llama_config(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                       head_dim=8, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1],
                       router_aux_loss_coef=0.001)
    out.append(Case("qwen3_moe", "qwen3_moe", "qwen3_moe", cfg, shapes, _identity(shapes),
                    hf_checks={"num_experts": 4, "mlp_only_layers": [1]}))
    # HF gpt-oss, bf16 (MXFP4 experts: tests/converters/test_mxfp4.py): q/k/v/o biases,
    # sinks, a biased router, 4 experts of width 8 (gate/up interleaved, [E, H, 2I]),
    # transformers-v5 rope_parameters (YaRN), one sliding layer.
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
              "lm_head.weight": (V, H)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({k: v for k, v in decoder_layer(p, hd=8, qkv_bias=True).items()
                       if ".mlp." not in k})
        shapes.update({f"{p}self_attn.o_proj.bias": (H,), f"{p}self_attn.sinks": (NH,),
                       f"{p}mlp.router.weight": (4, H), f"{p}mlp.router.bias": (4,),
                       f"{p}mlp.experts.gate_up_proj": (4, H, 16),
                       f"{p}mlp.experts.gate_up_proj_bias": (4, 16),
                       f"{p}mlp.experts.down_proj": (4, 8, H),
                       f"{p}mlp.experts.down_proj_bias": (4, H)})
    cfg = llama_config(architectures=["GptOssForCausalLM"], model_type="gpt_oss", head_dim=8,
                       intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                       sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                       attention_bias=True, swiglu_limit=7.0, torch_dtype="bfloat16",
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "truncate": False, "rope_theta": 1.5e5,
                                        "original_max_position_embeddings": 64})
    cfg.pop("rope_theta")
    out.append(Case("gpt_oss", "gpt_oss", "gpt_oss", cfg, shapes, _identity(shapes),
                    dtype=ml_dtypes.bfloat16,
                    hf_checks={"rope_theta": 1.5e5, "sliding_window": 6,
                               "num_local_experts": 4}))
    # MiMo (the target): a Qwen2 decoder plus 2 MTP modules, dropped; sharded safetensors.
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
              "lm_head.weight": (V, H)}
    for i in range(2):
        shapes.update(decoder_layer(f"model.layers.{i}.", qkv_bias=True))
    mtp = {}
    for i in range(2):
        mtp.update(mtp_module(f"model.mtp_layers.{i}."))
    shapes.update(mtp)
    cfg = llama_config(architectures=["MiMoForCausalLM"], model_type="mimo", rope_theta=640000.0,
                       num_nextn_predict_layers=2, use_sliding_window=False)
    out.append(Case("mimo", "mimo", "qwen2", cfg, shapes, _identity(shapes, drop=list(mtp)),
                    layout="safetensors-sharded",
                    hf_checks={"attention_bias": True, "num_hidden_layers": 2}))
    # MiMo MTP head, head only (what export writes): module 0, no trunk, bf16.
    shapes = mtp_module("model.mtp_layers.0.")
    cfg = llama_config(architectures=["MiMoForCausalLM"], model_type="mimo", num_hidden_layers=0,
                       num_nextn_predict_layers=1, torch_dtype="bfloat16")
    out.append(Case("mimo_mtp", "mimo-mtp", "mtp", cfg, shapes,
                    {k: mtp_canonical(k) for k in shapes}, dtype=ml_dtypes.bfloat16,
                    hf_checks={"num_hidden_layers": 1, "num_nextn_predict_layers": 1,
                               "qkv_bias": True, "o_bias": False}))
    # EAGLE-1 (SafeAILab): pytorch_model.bin, fp16, fc.bias, no `bias` in config, layer 0
    # without input_layernorm, optional embed_tokens.
    shapes = {"fc.weight": (H, 2 * H), "fc.bias": (H,), "embed_tokens.weight": (V, H)}
    shapes.update(decoder_layer("layers.0.", input_norm=False))
    cfg = llama_config(num_hidden_layers=1, torch_dtype="float16")
    out.append(Case("eagle", "eagle", "eagle", cfg, shapes, _identity(shapes), layout="bin",
                    dtype=np.float16, hf_checks={"bias": True}))
    # EAGLE-3 (SafeAILab): midlayer.*, d2t int64 / t2d bool, no embedding, llama3 rope.
    shapes = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (VD, H),
              "d2t": ((VD,), np.int64), "t2d": ((V,), np.bool_)}
    shapes.update(decoder_layer("midlayer.", width=2 * H, hidden_norm=True))
    canonical = {k: k.replace("midlayer.", "layers.0.") for k in shapes}
    canonical["t2d"] = None
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = llama_config(num_hidden_layers=1, draft_vocab_size=VD, rope_scaling=scaling)
    out.append(Case("eagle3", "eagle3", "eagle3", cfg, shapes, canonical, layout="bin",
                    hf_checks={"draft_vocab_size": VD, "target_hidden_size": H,
                               "norm_before_residual": False,
                               "eagle_aux_hidden_state_layer_ids": None}))
    # EAGLE-3 (speculators): layers.0.*, nested transformer_layer_config, embed present.
    shapes = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (VD, H),
              "embed_tokens.weight": (V, H), "d2t": ((VD,), np.int64),
              "t2d": ((V,), np.bool_)}
    shapes.update(decoder_layer("layers.0.", width=2 * H, hidden_norm=True))
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "transformer_layer_config": llama_config(num_hidden_layers=1),
           "draft_vocab_size": VD, "target_hidden_size": None, "norm_before_residual": True,
           "eagle_aux_hidden_state_layer_ids": [1, 3, 5],
           "speculators_config": {"algorithm": "eagle3"}}
    out.append(Case("eagle3_spec", "eagle3-speculators", "eagle3", cfg, shapes,
                    _identity(shapes, drop=["t2d"]), dtype=ml_dtypes.bfloat16,
                    hf_checks={"norm_before_residual": True, "target_hidden_size": H,
                               "eagle_aux_hidden_state_layer_ids": [1, 3, 5]}))
    # ... without norm_before_residual: vLLM v0.20's speculators updater (update_eagle3)
    # defaults it to True, unlike the SafeAILab case above (the model code's False).
    cfg = {k: v for k, v in cfg.items() if k != "norm_before_residual"}
    out.append(Case("eagle3_spec_default", "eagle3-speculators", "eagle3", cfg, shapes,
                    _identity(shapes, drop=["t2d"]), dtype=ml_dtypes.bfloat16,
                    hf_checks={"norm_before_residual": True}))
    # DFlash (z-lab): no prefix, no embedding / lm_head, target_layer_ids shifted by +1.
    shapes = {"fc.weight": (H, 3 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(2):
        shapes.update(decoder_layer(f"layers.{i}.", qk_norm=True))
    cfg = llama_config(architectures=["DFlashDraftModel"], model_type="qwen3",
                       block_size=4, num_target_layers=8, head_dim=HD,
                       dflash_config={"mask_token_id": V - 1, "target_layer_ids": [1, 3, 5]},
                       auto_map={"AutoModel": "dflash.DFlashDraftModel"})
    out.append(Case("dflash", "dflash", "dflash", cfg, shapes, _identity(shapes),
                    dtype=ml_dtypes.bfloat16,
                    hf_checks={"aux_hidden_state_layer_ids": [2, 4, 6], "block_size": 4,
                               "mask_token_id": V - 1, "dflash_config": {},
                               "draft_vocab_size": V, "target_hidden_size": H}))
    # DFlash (speculators): aux ids as given, reduced vocab with lm_head + d2t.
    shapes = {"fc.weight": (H, 3 * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
              "lm_head.weight": (VD, H), "d2t": ((VD,), np.int64), "t2d": ((V,), np.bool_)}
    for i in range(2):
        shapes.update(decoder_layer(f"layers.{i}.", qk_norm=True))
    tl = llama_config(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=HD)
    cfg = {"speculators_model_type": "dflash", "transformer_layer_config": tl,
           "draft_vocab_size": VD, "block_size": 8, "aux_hidden_state_layer_ids": [2, 4, 6],
           "mask_token_id": 5, "target_hidden_size": None}
    out.append(Case("dflash_spec", "dflash-speculators", "dflash", cfg, shapes,
                    _identity(shapes, drop=["t2d"]),
                    hf_checks={"aux_hidden_state_layer_ids": [2, 4, 6], "block_size": 8,
                               "draft_vocab_size": VD}))
    out += dspark_cases()
    # Medusa-1 (FasterDecoding): medusa_lm_head.pt; config undercounts heads.
    shapes = {}
    canonical = {}
    for h in range(3):
        shapes[f"{h}.0.linear.weight"] = (H, H)
        shapes[f"{h}.0.linear.bias"] = (H,)
        shapes[f"{h}.1.weight"] = (V, H)
        canonical[f"{h}.0.linear.weight"] = f"blocks.{h}.layers.0.weight"
        canonical[f"{h}.0.linear.bias"] = f"blocks.{h}.layers.0.bias"
        canonical[f"{h}.1.weight"] = f"lm_heads.{h}.weight"
    cfg = {"medusa_num_heads": 2, "medusa_num_layers": 1,
           "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}
    out.append(Case("medusa", "medusa", "medusa", cfg, shapes, canonical, layout="medusa-pt",
                    dtype=np.float16,
                    hf_checks={"num_heads": 3, "num_hidden_layers": 1, "medusa_fc_bias": True,
                               "hidden_size": H, "vocab_size": V}))
    # Medusa (vLLM): blocks.*, lm_heads.*, 2 ResBlock layers, no bias.
    shapes = {}
    for h in range(2):
        for l in range(2):
            shapes[f"blocks.{h}.layers.{l}.weight"] = (H, H)
        shapes[f"lm_heads.{h}.weight"] = (V, H)
    cfg = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": H,
           "vocab_size": V, "medusa_num_heads": 2, "medusa_num_layers": 2}
    out.append(Case("medusa_vllm", "medusa-vllm", "medusa", cfg, shapes, _identity(shapes),
                    hf_checks={"num_heads": 2, "num_hidden_layers": 2,
                               "medusa_fc_bias": False}))
    return out


def dspark_cases() -> list[Case]:
    """DSpark (research/vllm_delta_0.34.md section 3): its three config styles, each head
    type, the confidence head on [h] / [h, m] / off (its tensors then dropped)."""
    out = []
    base = {"fc.weight": (H, 3 * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
            "markov_head.markov_w1.weight": (V, R), "markov_head.markov_w2.weight": (V, R)}
    for i in range(2):
        base.update(decoder_layer(f"layers.{i}.", qk_norm=True))
    conf = {"confidence_head.proj.weight": (1, H), "confidence_head.proj.bias": (1,)}
    # DeepSpec: Qwen3DSparkModel, every key at the top level; vanilla, confidence on [h].
    cfg = llama_config(architectures=["Qwen3DSparkModel"], model_type="qwen3", head_dim=HD,
                       block_size=4, mask_token_id=V - 1, target_layer_ids=[1, 3, 5],
                       num_target_layers=8, num_anchors=32, markov_rank=R,
                       markov_head_type="vanilla", enable_confidence_head=True,
                       confidence_head_with_markov=False)
    shapes = {**base, **conf}
    out.append(Case("dspark_deepspec", "dspark", "dspark", cfg, shapes, _identity(shapes),
                    dtype=ml_dtypes.bfloat16,
                    hf_checks={"aux_hidden_state_layer_ids": [2, 4, 6], "block_size": 4,
                               "mask_token_id": V - 1, "markov_rank": R,
                               "markov_head_type": "vanilla", "enable_confidence_head": True,
                               "confidence_head_with_markov": False, "dflash_config": {}}))
    # SpecForge qwen3-8b: DSparkDraftModel, the DSpark keys in dflash_config; gated head,
    # confidence on [h, m].
    dcfg = {"mask_token_id": 3, "target_layer_ids": [0, 2], "projector_type": "dspark",
            "markov_rank": R, "markov_head_type": "gated", "confidence_head_alpha": 1.0,
            "enable_confidence_head": True, "confidence_head_with_markov": True}
    cfg = llama_config(architectures=["DSparkDraftModel"], model_type="qwen3", head_dim=HD,
                       block_size=16, dflash_config=dcfg)
    shapes = {**base, "fc.weight": (H, 2 * H), "markov_head.gate_proj.weight": (R, H + R),
              "markov_head.gate_proj.bias": (R,), "confidence_head.proj.weight": (1, H + R),
              "confidence_head.proj.bias": (1,)}
    out.append(Case("dspark_specforge", "dspark", "dspark", cfg, shapes, _identity(shapes),
                    hf_checks={"aux_hidden_state_layer_ids": [1, 3], "block_size": 16,
                               "mask_token_id": 3, "markov_head_type": "gated",
                               "confidence_head_with_markov": True, "dflash_config": {}}))
    # SpecForge qwen3.6: mask / ids in dflash_config, Markov keys in dspark_config; an rnn
    # head under Mistral-Large-4's name, a reduced vocab (lm_head, d2t; t2d dropped) and
    # confidence tensors with the head off (dropped, as vLLM does).
    cfg = llama_config(architectures=["DSparkDraftModel"], model_type="qwen3", head_dim=HD,
                       dflash_config={"mask_token_id": 5, "target_layer_ids": [1, 3, 5],
                                      "projector_type": "dspark", "attention_mode": "gqa",
                                      "block_size": 8},
                       dspark_config={"markov_rank": R, "markov_head_type": "rnn",
                                      "enable_confidence_head": False,
                                      "sample_from_anchor": False},
                       draft_vocab_size=VD)
    shapes = {**base, **conf, "markov_head.markov_w2.weight": (VD, R),
              "autoregressive_head.joint_proj.weight": (3 * R, 2 * R + H),
              "autoregressive_head.joint_proj.bias": (3 * R,), "lm_head.weight": (VD, H),
              "d2t": ((VD,), np.int64), "t2d": ((V,), np.bool_)}
    canonical = _identity(shapes, drop=["t2d", *conf])
    for k in ("weight", "bias"):
        canonical[f"autoregressive_head.joint_proj.{k}"] = f"markov_head.joint_proj.{k}"
    out.append(Case("dspark_qwen36", "dspark", "dspark", cfg, shapes, canonical,
                    layout="safetensors-sharded",
                    hf_checks={"aux_hidden_state_layer_ids": [2, 4, 6], "block_size": 8,
                               "mask_token_id": 5, "markov_head_type": "rnn",
                               "enable_confidence_head": False, "sample_from_anchor": False,
                               "draft_vocab_size": VD}))
    return out


CASES = {c.name: c for c in cases()}
