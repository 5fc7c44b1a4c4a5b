"""The price sheet: on-demand $/chip-hour, $/core-hour for sandbox hosts, hosted-API $/token.

Every entry carries the page it was read from and the date. Prices were looked up on
2026-12-01 in stored copies of public pages; where no published on-demand price was found the
chip is absent, and `plan.py --cost` asks for it (`--prices FILE`). Absent: gaudi3, trn2 (no
on-demand price found), tpu-v5e, tpu-v5p, tpu-v6e, tpu7x (Google's pricing page was not found
with per-chip figures). A user file (JSON, same shape as `PRICE_SHEET`) overrides entries by
name; see docs/planner.md.
"""

from __future__ import annotations

PRICE_SHEET: dict = {
    "chips": {  # $ per chip-hour, on demand
        "h100": {"usd_per_hour": 7.0, "date": "read 2026-12-01 (page undated)",
                 "source": "Fireworks on-demand GPU-hour rates (H100_80GB $7.0), "
                           "https://docs.fireworks.ai/fine-tuning/multi-turn-cost-comparison"},
        "h200": {"usd_per_hour": 7.0, "date": "read 2026-12-01 (page undated)",
                 "source": "Fireworks on-demand GPU-hour rates (H200_141GB $7.0), "
                           "https://docs.fireworks.ai/fine-tuning/multi-turn-cost-comparison"},
        "b200": {"usd_per_hour": 10.0, "date": "read 2026-12-01 (page undated)",
                 "source": "Fireworks on-demand GPU-hour rates (B200_180GB $10.0), "
                           "https://docs.fireworks.ai/fine-tuning/multi-turn-cost-comparison"},
        "mi300x": {"usd_per_hour": 1.85, "date": "2025-01-01",
                   "source": "Vultr on-demand MI300X $1.85/GPU-hour as listed on "
                             "https://gpu.blog/gpus/instinct-mi300x-mi300x"},
        "mi325x": {"usd_per_hour": 2.25, "date": "read 2026-12-01 (page undated)",
                   "source": "cloud rental $2.00-$2.25/GPU-hour (upper end taken), "
                             "https://awesomeagents.ai/hardware/amd-mi325x"},
    },
    "cpu_core": {  # $ per core-hour of a sandbox host
        "usd_per_hour": 0.0408, "date": "2026-06-17",
        "source": "AWS EC2 m7g.large (2 vCPU = 2 Graviton cores) $0.0816/hour on demand, "
                  "us-east-1, as quoted on https://main.d1m6t5n8e4tvia.amplifyapp.com/blog/"
                  "amazon-ec2-on-demand-pricing-instance-families-2026/",
    },
    "hosted": {  # hosted training API, $ per million tokens
        "tinker-inkling": {
            "prefill": 1.87, "sample": 4.68, "train": 5.61, "date": "2026-10-07",
            "source": "Tinker models and pricing, Inkling (64K) (prefill under a limited-time "
                      "50% discount), https://tinker-docs.thinkingmachines.ai/tinker/models/"
                      "models_and_pricing/ as transcribed in api-evangelist/thinking-machines "
                      "plans/thinking-machines-plans-pricing.yml",
            "note": "LoRA training on Tinker's own model; no Tinker price was found for GLM-5 "
                    "or Qwen3-235B-A22B"},
        "tinker-qwen3-8b": {
            "prefill": 0.195, "sample": 0.60, "train": 0.44, "date": "2026-10-07",
            "source": "Tinker models and pricing, Qwen3-8B, https://tinker-docs."
                      "thinkingmachines.ai/tinker/models/models_and_pricing/ as transcribed in "
                      "api-evangelist/thinking-machines plans/thinking-machines-plans-pricing.yml",
            "note": "LoRA training"},
    },
}
