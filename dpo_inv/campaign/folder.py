"""A campaign folder, the one place that knows its layout:

    DIR/campaign.json               the design space, the models and the round settings (the first call's)
    DIR/run.lock                    held while a call writes a round
    DIR/round_0/measurements.csv    measurements made before the campaign (--measurements)
    DIR/round_N/proposals.csv       the batch of round N, and proposals.fasta, adapt.json, model/
    DIR/round_N/summary.json        the summary line of the call that wrote round N
    DIR/round_N/measurements.csv    what came back
    DIR/best.csv                    the best variants measured so far
    DIR/campaign.png                the picture
    DIR/zero_shot.npz               the candidates' zero-shot scores, kept for the next call

A round is staged in DIR/.round_N.tmp and renamed into place whole.
"""

from __future__ import annotations

import contextlib
import csv
import json
import shutil
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpo_inv.campaign.config import ProposeConfig
from dpo_inv.data.design import variant_keys
from dpo_inv.data.measurements import Measurement, read_measurements
from dpo_inv.data.records import write_json, write_text
from dpo_inv.errors import MeasurementError, OptionError
from dpo_inv.training.output_lock import LOCK_FILE, lock_folder

SETTINGS = "campaign.json"
MEASUREMENTS = "measurements.csv"
PROPOSALS = "proposals.csv"
ZERO_SHOT = "zero_shot.npz"


@dataclass(frozen=True)
class MeasuredRound:
    """One round's measurements file, read once: its rows and, where the round was proposed, its proposals'
    rows (None for measurements made before the campaign)."""

    round: int
    path: Path
    rows: list[Measurement]
    proposals: list[dict[str, str]] | None


@dataclass(frozen=True)
class CampaignFolder:
    path: Path

    @property
    def settings_file(self) -> Path:
        return self.path / SETTINGS

    @property
    def picture(self) -> Path:
        return self.path / "campaign.png"

    @property
    def best_file(self) -> Path:
        return self.path / "best.csv"

    def round_dir(self, n: int) -> Path:
        return self.path / f"round_{n}"

    def measurements_file(self, n: int) -> Path:
        return self.round_dir(n) / MEASUREMENTS

    def proposals_file(self, n: int) -> Path:
        return self.round_dir(n) / PROPOSALS

    def settings(self) -> dict[str, Any] | None:
        """What `campaign.json` holds (None: no campaign here yet), under the options' present names."""
        if not self.settings_file.exists():
            return None
        saved = json.loads(self.settings_file.read_text())
        return {ProposeConfig.RENAMED.get(name, name): value for name, value in saved.items()}

    def rounds(self) -> list[int]:
        """The numbers of the round folders, in order."""
        found = (p.name.split("_", 1)[1] for p in self.path.glob("round_*") if p.is_dir())
        return sorted(int(n) for n in found if n.isdigit())

    def last_proposed(self) -> int:
        """The last round proposed (0: none yet)."""
        return max([n for n in self.rounds() if n > 0], default=0)

    def check_measured(self) -> None:
        """The last round's proposals must have their measurements before another round."""
        last = self.last_proposed()
        if last and not self.measurements_file(last).exists():
            raise MeasurementError(
                f"{self.round_dir(last)}: its proposals await their measurements: write them to "
                f"{self.measurements_file(last)} (mutations,value), then propose again"
            )

    def measured_rounds(self, score_field: str | None, before: str | None = None) -> list[MeasuredRound]:
        """Every round's measurements, read once; ``before``: a file of measurements made before the
        campaign, read as round 0 where the folder has none."""
        measured = []
        if before is not None and not self.measurements_file(0).exists():
            measured.append(MeasuredRound(0, Path(before), read_measurements(before, score_field), None))
        for n in self.rounds():
            path = self.measurements_file(n)
            if path.exists():
                proposals = self.proposals_file(n)
                rows = list(csv.DictReader(proposals.open())) if proposals.exists() else None
                measured.append(MeasuredRound(n, path, read_measurements(path, score_field), rows))
        return measured

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the folder while a round is written: a second call on it is bad input naming the first."""
        if not self.path.exists():  # a first call: nothing to lock yet, nor any other call to meet
            yield
            return
        with contextlib.ExitStack() as stack:
            holder = lock_folder(stack, self.path)
            if holder is not None:
                raise OptionError(
                    f"{self.path} is in use by another propose ({holder}; see {self.path / LOCK_FILE}): wait "
                    "for it to end, then propose again"
                )
            yield

    def stage(self, n: int) -> Path:
        """An empty folder to write round ``n`` into (`commit` moves it into place)."""
        staging = self.path / f".round_{n}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return staging

    def commit(self, n: int, settings: dict[str, Any], before: str | None) -> Path:
        """Put the staged round ``n`` in place, with `campaign.json` on a first call and the measurements
        made before the campaign as round 0; returns the round's folder."""
        if not self.settings_file.exists():
            write_json(self.settings_file, settings)
        if before is not None and not self.measurements_file(0).exists():
            self.round_dir(0).mkdir(exist_ok=True)
            shutil.copyfile(before, self.measurements_file(0))
        (self.path / f".round_{n}.tmp").replace(self.round_dir(n))
        return self.round_dir(n)

    def read_zero_shot(self, fingerprint: str, parent: np.ndarray) -> dict[bytes, float]:
        """The zero-shot scores a call kept (`keep_zero_shot`), by variant key, where the models, structure
        and space that computed them are those of ``fingerprint``; else none."""
        path = self.path / ZERO_SHOT
        try:
            with np.load(path) as kept:
                if str(kept["fingerprint"]) != fingerprint:
                    return {}
                variants = np.repeat(parent[None].astype(np.uint8), len(kept["scores"]), 0)
                variants[:, kept["columns"]] = kept["tokens"]
                scores = kept["scores"].tolist()
        except (OSError, ValueError, KeyError, IndexError, zipfile.BadZipFile):  # none or damaged: computed
            return {}
        return dict(zip(variant_keys(variants), scores, strict=True))

    def keep_zero_shot(self, fingerprint: str, parent: np.ndarray, scores: dict[bytes, float]) -> None:
        """Keep ``scores`` (by variant key: `variant_key` of a variant of ``parent``) for the next call, as
        the tokens of the columns where any variant differs from the parent."""
        variants = np.frombuffer(b"".join(scores), dtype=np.uint8).reshape(len(scores), len(parent))
        columns = np.flatnonzero((variants != parent).any(0))
        values = np.fromiter(scores.values(), np.float64, len(scores))
        tmp = self.path / f".{ZERO_SHOT}.tmp"
        with tmp.open("wb") as handle:
            np.savez(handle, fingerprint=np.array(fingerprint), columns=columns, tokens=variants[:, columns],
                     scores=values)  # fmt: skip
        tmp.replace(self.path / ZERO_SHOT)

    def write_summary(self, n: int, summary: dict[str, Any]) -> None:
        write_json(self.round_dir(n) / "summary.json", summary)

    def write_best(self, rows: list[tuple[str, float, int]]) -> None:
        """`best.csv`: the best measured variants so far, best first (mutations, value, round: a file of
        measurements, as `--measurements` and `--include` read them)."""
        lines = "".join(f"{variant},{value!r},{n}\n" for variant, value, n in rows)
        write_text(self.best_file, "mutations,value,round\n" + lines)
