"""A batch shared between two sources by how each has done on the campaign's own measurements: the
predictor's draws and the zero-shot ranking's unmeasured top. The predictor weighs the zero-shot score by
its fit over everything measured; where the score's top is right and its ranking of the rest is not (most of
a library dead, Spearman near zero), that weight is small or negative and the predictor ranks the score's
best last. Each source's record is its precision at the top: of the measured variants it puts first, the
share among the best tenth measured (the zero-shot ranking: those it has already passed, scoring above every
candidate left; the predictor: its out-of-fold predictions' top tenth). The zero-shot top gets a share of the
batch in proportion to its record against the predictor's (each with one hit and one miss as prior)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HIT_QUANTILE = 0.9  # a hit: a value above this quantile of the values measured
PREDICTOR_TOP = 0.1  # the predictor's record: its out-of-fold top tenth of the measured (at least MIN_TOP)
MIN_TOP = 5


@dataclass(frozen=True)
class Record:
    """How one source has done: ``hits`` of the ``tried`` measured variants it puts first."""

    hits: int
    tried: int

    @property
    def rate(self) -> float:
        """The hit rate with one hit and one miss as prior."""
        return (1 + self.hits) / (2 + self.tried)

    def __str__(self) -> str:
        return f"{self.hits} of {self.tried}"


@dataclass(frozen=True)
class Portfolio:
    """The batch's split: ``zero_shot`` of it from the zero-shot ranking's unmeasured top, the rest from the
    predictor, by the two records."""

    zero_shot: int
    predictor: int
    zero_shot_record: Record
    predictor_record: Record

    def why(self) -> str:
        return (
            f"{self.zero_shot} from the zero-shot ranking's unmeasured top (hits among the measured variants "
            f"it ranks first: {self.zero_shot_record}), {self.predictor} from the predictor (hits in its "
            f"out-of-fold top: {self.predictor_record})"
        )


def records(values: np.ndarray, measured_scores: np.ndarray, candidate_scores: np.ndarray,
            out_of_fold: np.ndarray) -> tuple[Record, Record]:  # fmt: skip
    """The zero-shot ranking's record and the predictor's on the measured ``values``: of the measured
    variants each puts first, how many are hits (above `HIT_QUANTILE` of ``values``). The zero-shot ranking
    puts first those scoring above every candidate (``candidate_scores``) left; the predictor the top
    `PREDICTOR_TOP` (at least `MIN_TOP`) of its ``out_of_fold`` predictions."""
    hit = values > np.quantile(values, HIT_QUANTILE)
    passed = measured_scores > candidate_scores.max(initial=-np.inf)
    count = min(len(values), max(MIN_TOP, int(round(PREDICTOR_TOP * len(values)))))
    first = np.argsort(-out_of_fold, kind="stable")[:count]
    return Record(int(hit[passed].sum()), int(passed.sum())), Record(int(hit[first].sum()), count)


def split(batch: int, zero_shot: Record, predictor: Record) -> Portfolio:
    """The batch split in proportion to the two records' hit rates."""
    share = zero_shot.rate / (zero_shot.rate + predictor.rate)
    count = int(round(share * batch))
    return Portfolio(count, batch - count, zero_shot, predictor)
