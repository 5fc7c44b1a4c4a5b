"""The cost view: a plan in, $ per 1M rollouts, $ per RL step and who spends it out.

For a split of C_t trainer + C_g generator chips at p $/chip-hour, consuming r rollouts/s with
n sandbox cores at q $/core-hour (n from `analytic.sandbox_cores`, Little's law):

    $/hour            H = (C_t + C_g)·p + n·q
    $ per 1M rollouts   = H / (3600·r) · 1e6
    $ per RL step       = H · step_s / 3600
    split               = C_t·p / H (trainer), C_g·p / H (generator), n·q / H (sandbox)

Chips are paid while idle, so a starved trainer costs as much per hour as a busy one: the
recommended split lowers $ per rollout by raising r at the same H. With `objective="cost"` the
split is chosen by $ per rollout (`cheapest`). Among splits of the same chips the two orders
coincide (H is fixed but for the sandbox term, whose cost per rollout is constant), so
`--objective cost` also weighs smaller chip totals (cli.py).

Hosted API (per-token prices, $ per million tokens): a rollout of P prompt and R response
tokens costs P·prefill + R·sample + epochs·(P + R)·train, per million tokens.

Built-in prices: data/prices.toml (`PRICE_SHEET`), a row each with its source and date. A JSON
file of the same sections (`--prices FILE`) adds or replaces rows by name (docs/planner.md).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Sequence

from jaxrl.planner import tables
from jaxrl.planner.recommend import SplitResult

HOUR = 3600.0
FIELDS = {"chips": {"usd_per_hour": float}, "cpu_core": {"usd_per_hour": float},
          "hosted": {"prefill": float, "sample": float, "train": float}}
SECTIONS = tuple(FIELDS)


def load_prices(path: str | None = None) -> dict:
    """The built-in price sheet, with the entries of the JSON file at `path` replacing its own
    (by chip name, hosted-API name, or the whole `cpu_core` entry)."""
    sheet = copy.deepcopy(PRICE_SHEET)
    if path is None:
        return sheet
    with open(path) as f:
        user = json.load(f)
    for section, entries in user.items():
        if section in ("chips", "hosted"):
            sheet[section].update(entries)
        else:  # cpu_core, or a section check_sheet refuses
            sheet[section] = entries
    return check_sheet(sheet, path)


def check_sheet(sheet: dict, path: object = "price sheet") -> dict:
    """`sheet` with every row checked (tables.check_row): its prices, a source and an ISO date.
    `path` names the file in the error."""
    unknown = sorted(set(sheet) - set(SECTIONS))
    if unknown:
        raise ValueError(f"{path}: unknown sections {unknown}; valid: {list(SECTIONS)}")
    for section in ("chips", "hosted"):
        sheet[section] = {name: tables.check_row(path, f"{section}.{name}", e, FIELDS[section])
                          for name, e in sheet.get(section, {}).items()}
    sheet["cpu_core"] = tables.check_row(path, "cpu_core", sheet.get("cpu_core"),
                                         FIELDS["cpu_core"])
    return sheet


_SHEET_PATH = tables.DATA / "prices.toml"
PRICE_SHEET = check_sheet(tables.read(_SHEET_PATH), _SHEET_PATH)  # read once, at import


def chip_price(sheet: dict, hardware: str) -> float:
    try:
        return float(sheet["chips"][hardware]["usd_per_hour"])
    except KeyError:
        raise ValueError(
            f"no on-demand price for {hardware!r} in the price sheet (priced: "
            f"{sorted(sheet['chips'])}); give one with --prices FILE, e.g. "
            f'{{"chips": {{"{hardware}": {{"usd_per_hour": 2.0, "source": "...", '
            f'"date": "..."}}}}}}') from None


@dataclasses.dataclass(frozen=True)
class Cost:
    trainer_usd_h: float
    generator_usd_h: float
    sandbox_usd_h: float
    rollouts_per_s: float
    step_s: float

    @property
    def usd_per_hour(self) -> float:
        return self.trainer_usd_h + self.generator_usd_h + self.sandbox_usd_h

    @property
    def usd_per_million(self) -> float:
        return self.usd_per_hour / (HOUR * self.rollouts_per_s) * 1e6

    @property
    def usd_per_step(self) -> float:
        return self.usd_per_hour * self.step_s / HOUR

    def split(self) -> dict[str, float]:
        h = self.usd_per_hour
        return {"trainer": self.trainer_usd_h / h, "generator": self.generator_usd_h / h,
                "sandbox": self.sandbox_usd_h / h}


def plan_cost(trainer_chips: int, generator_chips: int, rollouts_per_s: float, step_s: float,
              sandbox_cores: float, chip_usd_h: float, core_usd_h: float) -> Cost:
    if rollouts_per_s <= 0:
        raise ValueError(f"rollouts_per_s must be > 0, got {rollouts_per_s}")
    return Cost(trainer_chips * chip_usd_h, generator_chips * chip_usd_h,
                sandbox_cores * core_usd_h, rollouts_per_s, step_s)


def split_cost(r: SplitResult, chip_usd_h: float, core_usd_h: float,
               sandbox_s_per_rollout: float, sandbox_utilization: float) -> Cost:
    cores = r.rates.consumed_per_s * sandbox_s_per_rollout / sandbox_utilization
    return plan_cost(r.trainer_chips, r.generator_chips, r.rates.consumed_per_s,
                     r.rates.step_s, cores, chip_usd_h, core_usd_h)


def cheapest(candidates: Sequence[SplitResult], cost_of: Callable[[SplitResult], Cost]
             ) -> SplitResult:
    """The candidate with the lowest $ per rollout (ties: the earlier, i.e. faster, one)."""
    if not candidates:
        raise ValueError("no candidates to price")
    return min(candidates, key=lambda c: cost_of(c).usd_per_million)


def hosted_usd_per_million(entry: dict, prompt_tokens: float, response_tokens: float,
                           epochs: int = 1) -> float:
    """$ per 1M rollouts on a hosted API priced per million tokens (module docstring)."""
    per_rollout = (prompt_tokens * entry["prefill"] + response_tokens * entry["sample"]
                   + epochs * (prompt_tokens + response_tokens) * entry["train"]) / 1e6
    return per_rollout * 1e6


def format_cost(label: str, split: str, c: Cost) -> str:
    s = c.split()
    return (f"{label:<12} {split:>9}: ${c.usd_per_million:,.0f} per 1M rollouts, "
            f"${c.usd_per_step:,.2f} per RL step, ${c.usd_per_hour:,.0f}/hour "
            f"(trainer {s['trainer']:.0%}, generator {s['generator']:.0%}, "
            f"sandbox {s['sandbox']:.1%}) at {c.rollouts_per_s:.4g} rollouts/s")


def format_hosted(name: str, entry: dict, prompt_tokens: float, response_tokens: float,
                  epochs: int = 1) -> str:
    usd = hosted_usd_per_million(entry, prompt_tokens, response_tokens, epochs)
    return (f"hosted API {name}: ${usd:,.0f} per 1M rollouts of {prompt_tokens:,.0f} prompt + "
            f"{response_tokens:,.0f} response tokens (prefill ${entry['prefill']}, sample "
            f"${entry['sample']}, train ${entry['train']} per 1M tokens, x{epochs} epoch; "
            f"{entry['date']}; {entry['source']}"
            + (f"; {entry['note']}" if entry.get("note") else "") + ")")
