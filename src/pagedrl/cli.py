"""`pagedrl <command>`: the command line. Each command lives in its own module; this file only routes."""

from __future__ import annotations

import sys

COMMANDS = ("demo", "generate", "serve", "eval", "sft", "rm", "dpo", "kto", "grpo", "rloo", "ppo", "distill", "rlhf", "merge")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: pagedrl {" + ",".join(COMMANDS) + "} [args]\n\n"
              "  demo       paged attention measured, then GRPO vs DPO vs RLHF side by side, with a report\n"
              "  generate   generate text offline with the paged engine\n"
              "  serve      OpenAI-compatible HTTP server\n"
              "  eval       held-out accuracy of a model on the built-in arithmetic task\n"
              "  sft|rm|dpo|kto|grpo|rloo|ppo   train: pagedrl <algorithm> [config.yaml] [key=value ...]\n"
              "  distill    on-policy distillation from a teacher: pagedrl distill [config.yaml] [key=value ...]\n"
              "  rlhf       the RLHF recipe: verifier-labelled pairs, a reward model, then PPO\n"
              "  merge      fold a LoRA adapter into its base: pagedrl merge BASE ADAPTER OUT\n")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from pagedrl.demo.cli import demo_main

        return demo_main(rest)
    if command == "generate":
        from pagedrl.generate import generate_main

        return generate_main(rest)
    if command == "serve":
        from pagedrl.server.serve import serve_main

        return serve_main(rest)
    if command == "eval":
        from pagedrl.train.evaluate import eval_main

        return eval_main(rest)
    if command == "merge":
        from pagedrl.merge import merge_main

        return merge_main(rest)
    if command == "rlhf":
        from pagedrl.train.rlhf import rlhf_main

        return rlhf_main(rest)
    if command in ("sft", "rm", "dpo", "kto", "grpo", "rloo", "ppo", "distill"):
        from pagedrl.train.cli import train_main

        return train_main(command, rest)
    print(f"pagedrl: unknown command {command!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
