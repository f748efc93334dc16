"""``python -m jaxtron.convert {import-hf,export-hf} ...``: Hugging Face folders <-> jaxtron checkpoints.

    python -m jaxtron.convert import-hf --hf-dir Llama-3.1-8B --out ckpt/llama3_8b
    python -m jaxtron.train --config ckpt/llama3_8b/config.yaml checkpoint.load_weights=ckpt/llama3_8b \\
        train.output_dir=runs/ft
    python -m jaxtron.convert export-hf --checkpoint runs/ft/checkpoints --out hf/ft
"""

from __future__ import annotations

import argparse
import sys

DTYPES = ("float32", "bfloat16", "float16")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{import-hf,export-hf}")
    imp = sub.add_parser("import-hf",
                         help="a Hugging Face Llama/Qwen2/Qwen3/Mixtral/Qwen3-MoE/DeepSeek-V3 folder -> a "
                              "weights-only jaxtron checkpoint",
                         description="Write a Hugging Face LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                                     "MixtralForCausalLM, Qwen3MoeForCausalLM or DeepseekV3ForCausalLM folder "
                                     "(config.json + safetensors) as a weights-only jaxtron checkpoint (step 0) plus "
                                     "OUT/config.yaml, a full jaxtron config whose model section comes from the "
                                     "HF config.")
    imp.add_argument("--hf-dir", required=True, help="the Hugging Face folder")
    imp.add_argument("--out", required=True, help="the checkpoint directory to create (must be new or empty)")
    imp.add_argument("--dtype", default="float32", choices=DTYPES,
                     help="dtype the weights are kept in (model.param_dtype) [default: float32]")
    exp = sub.add_parser("export-hf", help="a jaxtron checkpoint -> a Hugging Face folder",
                         description="Write a jaxtron checkpoint as a Hugging Face folder that "
                                     "transformers.AutoModelForCausalLM.from_pretrained loads (LlamaForCausalLM, "
                                     "Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM or "
                                     "DeepseekV3ForCausalLM (with model.mla and its MTP modules), as the model "
                                     "config says). The model config comes from the checkpoint.")
    exp.add_argument("--checkpoint", required=True,
                     help="a checkpoint directory (its newest step is used; e.g. <output_dir>/checkpoints or "
                          "the output of import-hf) or one step directory of it")
    exp.add_argument("--out", required=True, help="the Hugging Face folder to write")
    exp.add_argument("--dtype", default=None, choices=DTYPES,
                     help="storage dtype of the safetensors [default: the checkpoint's param dtype]")
    exp.add_argument("--max-shard-size", default="5GB",
                     help="split the weights into safetensors shards of at most this size "
                          "(5GB = 5*10^9 bytes, 5GiB = 5*2^30) [default: 5GB]")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from jaxtron.checkpoint import CheckpointError
    from jaxtron.config import ConfigError
    from jaxtron.convert import checkpoint_io as io

    try:
        if args.command == "import-hf":
            io.import_hf(args.hf_dir, args.out, args.dtype)
            print(f"wrote {args.out} (weights-only checkpoint, step 0) and {args.out}/{io.CONFIG_YAML}; fine-tune "
                  f"with: python -m jaxtron.train --config {args.out}/{io.CONFIG_YAML} "
                  f"checkpoint.load_weights={args.out} train.output_dir=...")
        else:
            shard = io.parse_size(args.max_shard_size)
            where = io.export_hf(args.checkpoint, args.out, args.dtype, shard)
            print(f"wrote {args.out} from {where}")
    except (CheckpointError, ConfigError, ValueError, OSError) as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
