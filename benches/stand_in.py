"""Stand-in models for speed runs where the packaged weights cannot go: the packaged models'
exact architectures and tokenizers with seeded random weights (speed does not depend on the
weight values; nothing measured with them is a quality number).

The accelerator machine receives at most 64 MiB, and the packaged weights alone are 189 MB, so
the device check ships only configs and tokenizers and fills in weights there:

    python -m benches.stand_in export --out .device/assets     # here: configs + tokenizers
    python -m benches.stand_in fill --assets .device/assets --out /tmp/models   # there

``export`` writes four folders: ``minilm`` (the packaged retriever's folder without its
weights), ``bert-base`` (the same with BERT-base's shape, that of Contriever and DPR),
``smollm2`` (the packaged GGUF's Llama configuration and tokenizer in Hugging Face layout)
and ``llama-1b`` (Llama-3.2-1B's published shape and Llama 3 RoPE scaling, with SmolLM2's
49,152-token vocabulary, since Llama 3's tokenizer is not available offline).
``fill`` adds a ``model.safetensors`` of random weights (transformers' own initialisation,
``torch.manual_seed(0)``) to each, so that our loaders and the PyTorch references read the same
files.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

from replug_jax.fileio import write_json_atomic

# Llama-3.2-1B's published config.json, but for its vocabulary (see the module docstring).
LLAMA_1B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "rope_theta": 500000.0, "torch_dtype": "bfloat16"}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def smollm2_hf_config() -> dict:
    """The packaged SmolLM2 GGUF's architecture as a Hugging Face ``config.json``."""
    from replug_jax.models import llama
    from replug_jax.models.weights import packaged_path, read_gguf

    meta, tensors = read_gguf(packaged_path("smollm2"))
    cfg = llama.config_from_gguf(meta, set(tensors))
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}


def export(out: pathlib.Path) -> None:
    from replug_jax.models import load_tokenizer
    from replug_jax.models.weights import packaged_path

    out.mkdir(parents=True, exist_ok=True)
    minilm = out / "minilm"
    shutil.rmtree(minilm, ignore_errors=True)
    shutil.copytree(packaged_path("minilm"), minilm,
                    ignore=shutil.ignore_patterns(*WEIGHT_FILES, "*.onnx", "*.h5"))
    # BERT-base's shape (Contriever, DPR) with MiniLM's vocabulary and tokenizer
    base = out / "bert-base"
    shutil.rmtree(base, ignore_errors=True)
    shutil.copytree(minilm, base)
    cfg = json.loads((minilm / "config.json").read_text())
    cfg.update(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
               intermediate_size=3072)
    write_json_atomic(cfg, base / "config.json")
    tokenizer = load_tokenizer("smollm2")
    smol = smollm2_hf_config()
    for name, cfg in (("smollm2", smol), ("llama-1b", {**LLAMA_1B, **{
            k: smol[k] for k in ("vocab_size", "bos_token_id", "eos_token_id",
                                 "pad_token_id")}})):
        folder = out / name
        folder.mkdir(exist_ok=True)
        write_json_atomic(cfg, folder / "config.json")
        tokenizer.save_pretrained(str(folder))
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} under {out}")


def fill(assets: pathlib.Path, out: pathlib.Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for src in sorted(p for p in assets.iterdir() if (p / "config.json").exists()):
        dst = out / src.name
        if (dst / "model.safetensors").exists():
            continue
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        config = AutoConfig.from_pretrained(str(src))
        dtype = getattr(torch, json.loads((src / "config.json").read_text()).get(
            "torch_dtype", "float32"))
        torch.manual_seed(0)
        auto = AutoModel if config.model_type == "bert" else AutoModelForCausalLM
        with torch.device(device):
            model = auto.from_config(config, dtype=dtype)
        model.save_pretrained(str(dst), safe_serialization=True)
        print(f"{dst}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M random "
              f"parameters ({dtype})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write configs and tokenizers (needs the packaged models)")
    ex.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".device/assets"),
                    help="folder to write (default .device/assets)")
    fi = sub.add_parser("fill", help="add seeded random weights to exported folders")
    fi.add_argument("--assets", type=pathlib.Path, default=pathlib.Path(".device/assets"),
                    help="folder written by export (default .device/assets)")
    fi.add_argument("--out", type=pathlib.Path, required=True, help="where the models go")
    args = ap.parse_args(argv)
    if args.command == "export":
        export(args.out)
    else:
        fill(args.assets, args.out)


if __name__ == "__main__":
    main()
