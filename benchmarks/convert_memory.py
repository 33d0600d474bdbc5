"""Peak memory and wall time of ``specjax-convert`` on a random-weight sharded bf16 Llama.

    python benchmarks/convert_memory.py --gb 1.1            # ~1.1 GB, 0.5 GB shards
    python benchmarks/convert_memory.py --preset 8b         # Llama-3-8B shapes, ~16 GB

Builds the checkpoint (config.json, ``model-0000k-of-0000n.safetensors`` written tensor by
tensor, so the builder itself stays small, and the shard index) under ``--work`` (default
``$OUT`` or a temporary directory), converts it in a child process (``python -m
specjax.converters.cli SRC DST -q``) and reports the child's peak resident memory
(``ru_maxrss`` from ``wait4``) and wall time against the goal of issue 23: peak <= 1.2 x the
largest shard + 400 MB. One JSON line on stdout (also ``convert_memory.json`` under
``$OUT`` when set); exit status 1 when the goal is missed or the conversion fails.
``--check`` then loads the output in another child (checksums verified) and compares a
few tensors with the source bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
PRESETS = {
    # hidden, intermediate, heads, kv heads, vocab, layers (None: from --gb)
    "tiny": (2048, 5632, 16, 4, 32000, None),
    "8b": (4096, 14336, 32, 8, 128256, 32),
}


def llama_shapes(h, inter, nh, nkv, vocab, layers) -> dict[str, tuple[int, ...]]:
    hd = h // nh
    out = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (nh * hd, h),
            p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h),
            p + "self_attn.o_proj.weight": (h, nh * hd),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (vocab, h)
    return out


def _nbytes(shape) -> int:
    return int(np.prod(shape)) * 2


def layers_for(gb: float, h, inter, nh, nkv, vocab) -> int:
    per_layer = sum(_nbytes(s) for s in llama_shapes(h, inter, nh, nkv, vocab, 1).values()) \
        - sum(_nbytes(s) for s in llama_shapes(h, inter, nh, nkv, vocab, 0).values())
    rest = sum(_nbytes(s) for s in llama_shapes(h, inter, nh, nkv, vocab, 0).values())
    return max(1, round((gb * 1e9 - rest) / per_layer))


def random_tensor(shape, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * 0.02) \
        .astype(BF16).reshape(shape)


def write_shard(path: Path, names: list[str], shapes: dict, seeds: dict) -> None:
    """A safetensors file written one tensor at a time (the header first)."""
    header, off = {}, 0
    for k in names:
        n = _nbytes(shapes[k])
        header[k] = {"dtype": "BF16", "shape": list(shapes[k]), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for k in names:
            f.write(random_tensor(shapes[k], seeds[k]).tobytes())


def build(src: Path, h, inter, nh, nkv, vocab, layers, shard_bytes: int) -> dict:
    shapes = llama_shapes(h, inter, nh, nkv, vocab, layers)
    seeds = {k: i for i, k in enumerate(shapes)}
    shards, cur, size = [], [], 0
    for k, s in shapes.items():
        if cur and size + _nbytes(s) > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += _nbytes(s)
    shards.append(cur)
    src.mkdir(parents=True)
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_shard(src / fname, names, shapes, seeds)
        weight_map.update({k: fname for k in names})
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(_nbytes(s) for s in shapes.values())},
         "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inter, "num_attention_heads": nh, "num_key_value_heads": nkv,
        "num_hidden_layers": layers, "vocab_size": vocab, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    files = sorted(src.glob("*.safetensors"))
    return {"shapes": shapes, "seeds": seeds,
            "total_bytes": sum(f.stat().st_size for f in files),
            "largest_shard_bytes": max(f.stat().st_size for f in files),
            "n_shards": len(files), "n_tensors": len(shapes)}


def run_child(argv: list[str]) -> tuple[int, float, int, str]:
    """``(status, wall seconds, peak RSS bytes, stderr tail)`` of a child process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out_r, err_r = p.stdout, p.stderr
    _pid, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = err_r.read().decode(errors="replace")
    out_r.read()
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, wall, ru.ru_maxrss * 1024, (err[-2000:] if p.returncode else "")


CHECK = r"""
import sys, json, numpy as np
sys.path.insert(0, sys.argv[3])
from convert_memory import random_tensor
from specjax.converters import load_pretrained
info = json.loads(open(sys.argv[2]).read())
_, _, params = load_pretrained(sys.argv[1])
for key, path in (("model.norm.weight", ("norm", "weight")),
                  ("model.layers.0.mlp.up_proj.weight", ("layers", 0, "mlp", "up_proj", "kernel"))):
    a = params
    for p in path:
        a = a[p]
    want = random_tensor(info["shapes"][key], info["seeds"][key])
    want = want.T if path[-1] == "kernel" else want
    assert np.array_equal(np.asarray(a).view(np.uint16), np.ascontiguousarray(want).view(np.uint16)), key
print("ok")
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.1, help="checkpoint size (preset tiny)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--shard-gb", type=float, default=None,
                    help="largest shard size (default 0.5 for tiny, 5 for 8b as HF saves)")
    ap.add_argument("--work", default=None, help="where to build (default $OUT or a tmp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the output")
    ap.add_argument("--check", action="store_true",
                    help="load the output (checksums verified) and compare tensors")
    args = ap.parse_args(argv)
    h, inter, nh, nkv, vocab, layers = PRESETS[args.preset]
    if layers is None:
        layers = layers_for(args.gb, h, inter, nh, nkv, vocab)
    shard_gb = args.shard_gb or (5.0 if args.preset == "8b" else 0.5)
    out_env = os.environ.get("OUT")
    work = Path(args.work or out_env or tempfile.mkdtemp(prefix="convert_memory_"))
    work = work / f"convert_memory_{os.getpid()}"
    src, dst = work / "src", work / "dst"
    try:
        t0 = time.perf_counter()
        info = build(src, h, inter, nh, nkv, vocab, layers, int(shard_gb * 1e9))
        build_s = time.perf_counter() - t0
        code, wall, peak, err = run_child([sys.executable, "-m", "specjax.converters.cli",
                                           str(src), str(dst), "-q"])
        goal = 1.2 * info["largest_shard_bytes"] + 400e6
        res = {
            "benchmark": "convert_memory", "preset": args.preset, "layers": layers,
            "checkpoint_gb": round(info["total_bytes"] / 1e9, 3), "n_shards": info["n_shards"],
            "largest_shard_gb": round(info["largest_shard_bytes"] / 1e9, 3),
            "n_tensors": info["n_tensors"], "build_s": round(build_s, 1),
            "convert_status": code, "convert_wall_s": round(wall, 1),
            "peak_rss_gb": round(peak / 1e9, 3), "goal_gb": round(goal / 1e9, 3),
            "peak_over_largest_shard": round(peak / info["largest_shard_bytes"], 2),
            "goal_met": bool(code == 0 and peak <= goal),
        }
        if err:
            res["stderr"] = err
        if args.check and code == 0:
            info_f = work / "info.json"
            info_f.write_text(json.dumps({"shapes": info["shapes"], "seeds": info["seeds"]}))
            c_code, c_wall, c_peak, c_err = run_child(
                [sys.executable, "-c", CHECK, str(dst), str(info_f),
                 str(Path(__file__).resolve().parent)])
            res.update(check_status=c_code, check_wall_s=round(c_wall, 1),
                       check_peak_rss_gb=round(c_peak / 1e9, 3))
            if c_err:
                res["check_stderr"] = c_err
        line = json.dumps(res)
        print(line, flush=True)
        if out_env:
            Path(out_env, "convert_memory.json").write_text(line + "\n")
        return 0 if res["goal_met"] and res.get("check_status", 0) == 0 else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
