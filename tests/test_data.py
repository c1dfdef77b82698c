"""Preference files: formats, fields, validation errors, the structure cache and batching."""

import json
import os
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from conftest import SHARED_DATA, STRUCTURES

import dpo_inv.data.featurized as featurized
from dpo_inv.data.batches import BATCH_STRUCTURE_KEYS, ExampleDataset, LengthGroupedSampler, collate
from dpo_inv.data.dataset import VARIANTS, RecordSet, load_records
from dpo_inv.data.featurized import MIN_STRUCTURES_PER_PROCESS, build_structures, parse_processes
from dpo_inv.data.records import DataError, read_records
from dpo_inv.structures.parse import ALPHABET

TRAIN = SHARED_DATA / "train.jsonl"


def records(path: Path = TRAIN) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def absolute(rows: list[dict], folder: Path = SHARED_DATA) -> list[dict]:
    return [{**r, "pdb_file": str((folder / r["pdb_file"]).resolve())} for r in rows]


@pytest.fixture
def parse_count(monkeypatch):
    calls = []
    real = featurized.read_model

    def counting(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(featurized, "read_model", counting)
    return calls


def test_shared_train_file(cache_dir, parse_count):
    dataset = load_records(TRAIN, cache_dir=cache_dir)
    assert len(dataset.records) == 146
    assert len(dataset.structures) == 20 == len(parse_count)  # each structure parsed once for 146 pairs
    first = records()[0]
    row = dataset.records[0]
    assert "".join(ALPHABET[i] for i in row["chosen"]) == first["preferred_seq"]
    assert "".join(ALPHABET[i] for i in row["rejected"]) == first["unpreferred_seq"]
    assert row["weight"] == 1.0 and all(row["mutable"])


def test_cache_is_reused_and_invalidated_by_a_changed_file(tmp_path, cache_dir, parse_count):
    structure = tmp_path / "2xcjA.pdb.gz"
    shutil.copy(STRUCTURES / "2xcjA.pdb.gz", structure)
    keys = [(str(structure), ("A",), ())]
    first, folder, cached = build_structures(keys, cache_dir)
    assert not cached and len(parse_count) == 1
    again, again_folder, cached = build_structures(keys, cache_dir)
    assert cached and len(parse_count) == 1 and again_folder == folder
    assert again["X"] == first["X"]
    stat = structure.stat()
    os.utime(structure, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _, changed_folder, cached = build_structures(keys, cache_dir)
    assert not cached and len(parse_count) == 2 and changed_folder != folder


def test_a_cached_start_reads_no_record_and_sees_a_changed_structure(tmp_path, monkeypatch):
    """The second load takes the validated pairs (and the records skipped) from the cache without reading
    the data file's records; a structure file changed since sends the records through validation again."""
    rows = absolute(records())
    structure = tmp_path / "copy.pdb.gz"
    shutil.copy(rows[0]["pdb_file"], structure)
    original = rows[0]["pdb_file"]
    rows = [{**r, "pdb_file": str(structure)} if r["pdb_file"] == original else r for r in rows]
    on_copy = sum(r["pdb_file"] == str(structure) for r in rows)
    rows.append({**rows[0], "preferred_seq": "A"})  # of the wrong length: skipped
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    first = load_records(data, cache_dir=tmp_path / "cache", on_bad_record="skip")
    assert len(first.records) == len(rows) - 1 and len(first.skipped) == 1

    def unread(*args, **kwargs):
        raise AssertionError("the records were read")

    with monkeypatch.context() as patch:
        patch.setattr("dpo_inv.data.dataset.read_records", unread)
        cached = load_records(data, cache_dir=tmp_path / "cache", on_bad_record="skip")
    assert cached.files == first.files and cached.skipped == first.skipped
    assert cached.records.to_dict() == first.records.to_dict()

    shutil.copy(STRUCTURES / "2xcjA.pdb.gz", structure)  # another protein under the same name
    changed = load_records(data, cache_dir=tmp_path / "cache", on_bad_record="skip")
    assert len(changed.records) == len(rows) - 1 - on_copy and len(changed.skipped) == 1 + on_copy
    assert all(str(structure) in b.reason for b in changed.skipped[1:])


@pytest.mark.slow
def test_structures_parse_in_parallel_as_in_one_process(tmp_path):
    """By default one process per usable CPU parses, each with at least MIN_STRUCTURES_PER_PROCESS
    structures; the table is the one a single process makes."""
    count = 2 * MIN_STRUCTURES_PER_PROCESS
    sources = ["2xcjA.pdb.gz", "1bvyF.pdb.gz", "1BD2.pdb.gz"]
    keys = []
    for i in range(count):
        link = tmp_path / f"{i:03d}_{sources[i % 3]}"
        os.link(STRUCTURES / sources[i % 3], link)
        keys.append((str(link), (), ()))
    cpus = len(os.sched_getaffinity(0))
    assert parse_processes(None, count) == min(2, cpus) and parse_processes(None, count - 1) == 1
    assert parse_processes(1, count) == 1
    one, _, _ = build_structures(keys, tmp_path / "one", num_proc=1)
    default, _, _ = build_structures(keys, tmp_path / "default")
    assert default.to_dict() == one.to_dict()
    assert len({length for length in one["length"]}) == 3


@pytest.mark.parametrize("damage", ["truncated", "shorter", "missing_sizes", "half_written"])
def test_a_damaged_cache_is_rebuilt_never_read(tmp_path, parse_count, capsys, damage):
    """A killed first run or a full disk leaves a cache table incomplete: it is found, said and rebuilt."""
    cache = tmp_path / "cache"
    expected = load_records(TRAIN, cache_dir=cache)
    pairs_dir, structures_dir = map(Path, expected.files)
    expected_pairs, expected_structures = expected.records.to_dict(), expected.structures.to_dict()
    del expected
    arrow = next(pairs_dir.glob("*.arrow"))
    if damage == "truncated":
        os.truncate(arrow, arrow.stat().st_size // 2)
    elif damage == "shorter":  # a valid Arrow file of fewer rows, which datasets alone reads without a word
        short = tmp_path / "short"
        datasets.load_from_disk(str(pairs_dir)).select(range(100)).flatten_indices().save_to_disk(str(short))
        shutil.copy(next(short.glob("*.arrow")), arrow)
        assert datasets.load_from_disk(str(pairs_dir)).num_rows == 100
    elif damage == "missing_sizes":
        (pairs_dir / "dpo_inv_files.json").unlink()
    else:  # the structures table renamed into place by hand without its last file
        (structures_dir / "dpo_inv_files.json").unlink()
    capsys.readouterr()
    reloaded = load_records(TRAIN, cache_dir=cache)
    note = capsys.readouterr().out
    assert "is damaged" in note and "building it again" in note
    assert reloaded.records.to_dict() == expected_pairs
    assert reloaded.structures.to_dict() == expected_structures
    assert len(parse_count) == 20 * (2 if damage == "half_written" else 1)
    load_records(TRAIN, cache_dir=cache)
    assert "damaged" not in capsys.readouterr().out  # rebuilt whole


def test_formats_give_identical_pairs(tmp_path, cache_dir):
    rows = absolute(records()[:12])
    jsonl = write_jsonl(tmp_path / "pairs.jsonl", rows)
    as_list = tmp_path / "pairs.json"
    as_list.write_text(json.dumps(rows))
    table = datasets.Dataset.from_list(rows)
    table.to_csv(tmp_path / "pairs.csv", index=False)
    table.to_parquet(tmp_path / "pairs.parquet")
    expected = load_records(jsonl, cache_dir=cache_dir).records.to_dict()
    for name in ("pairs.json", "pairs.csv", "pairs.parquet"):
        assert load_records(tmp_path / name, cache_dir=cache_dir).records.to_dict() == expected, name


def test_aliases_chains_mutable_and_weight(tmp_path, cache_dir):
    multichain = records(SHARED_DATA / "multichain.jsonl")
    hvr = absolute([r for r in multichain if "1hvr" in r["pdb_file"]])[0]
    rows = [
        {
            "structure": hvr["pdb_file"],
            "chosen": hvr["preferred_seq"],
            "rejected": hvr["unpreferred_seq"],
            "design_chains": ["A"],
            "fixed_chains": ["B"],
            "mutable_positions": [0, 5, 97],
            "weight": 2.5,
        },
        {**hvr, "mutable_ranges": [[3, 5], [10, 10]]},
        {**{k: v for k, v in hvr.items() if k not in ("design_chains", "fixed_chains")}, "chain_id": "B"},
        {k: v for k, v in hvr.items() if k not in ("design_chains", "fixed_chains")},  # first chain designed
    ]
    dataset = load_records(write_jsonl(tmp_path / "p.jsonl", rows), cache_dir=cache_dir)
    assert [r for r in dataset.records["weight"]] == [2.5, 1.0, 1.0, 1.0]
    assert np.flatnonzero(dataset.records[0]["mutable"]).tolist() == [0, 5, 97]
    assert np.flatnonzero(dataset.records[1]["mutable"]).tolist() == [3, 4, 5, 10]
    structures = dataset.structures
    assert structures["design_chains"] == [["A"], ["B"], ["A"]]
    assert structures["fixed_chains"] == [["B"], [], []]
    assert structures["length"] == [196, 98, 98] and structures["num_designed"] == [98, 98, 98]
    batch = collate([ExampleDataset(dataset)[i] for i in range(4)])
    assert batch["loss_mask"].sum(1).tolist() == [3, 4, 98, 98]
    assert batch["decode_mask"][0, 98:].sum() == 0 and batch["mask"][0].sum() == 196
    assert batch["weight"].tolist() == [2.5, 1.0, 1.0, 1.0]


def test_relative_paths_resolve_against_the_data_files_folder(tmp_path, cache_dir, monkeypatch):
    folder = tmp_path / "project" / "pairs"
    folder.mkdir(parents=True)
    shutil.copytree(STRUCTURES, tmp_path / "project" / "structures")
    path = write_jsonl(folder / "train.jsonl", records()[:3])  # paths are ../structures/...
    monkeypatch.chdir(tmp_path)
    dataset = load_records(path, cache_dir=cache_dir)
    assert dataset.structures["path"] == [str(tmp_path / "project" / "structures" / "1bvyF.pdb.gz")]


def test_collate_pads_and_masks(cache_dir):
    dataset = ExampleDataset(load_records(SHARED_DATA / "val.jsonl", cache_dir=cache_dir))
    examples = [dataset[0], dataset[30]]
    lengths = [len(e["mask"]) for e in examples]
    batch = collate(examples)
    L = max(lengths)
    assert batch["X"].shape == (2, L, 4, 3) and batch["chosen"].dtype == torch.long
    short = int(np.argmin(lengths))
    assert batch["mask"][short, lengths[short] :].sum() == 0
    assert (batch["chosen"][short, lengths[short] :] == ALPHABET.index("X")).all()
    assert torch.equal(
        batch["chosen"][short, : lengths[short]], torch.as_tensor(examples[short]["chosen"]).long()
    )
    assert torch.equal(batch["loss_mask"], batch["mask"])  # single designed chains, all mutable, all observed


def test_a_batch_read_at_once_holds_the_rows(cache_dir):
    """`__getitems__` (what a DataLoader calls) gives each pair's row and its structure's, through a
    selection of the pairs too (as an eval split makes)."""
    data = load_records(TRAIN, cache_dir=cache_dir)
    chosen = [140, 3, 77, 12, 12]
    selected = RecordSet(data.records.select(chosen), data.structures, data.source)
    pairs, structures = data.records.with_format("numpy"), data.structures.with_format("numpy")
    examples = ExampleDataset(selected).__getitems__([4, 0, 2])
    assert [e["index"] for e in examples] == [4, 0, 2]
    for example, row in zip(examples, [12, 140, 77], strict=True):
        expected = {**structures[int(pairs[row]["structure_id"])], **pairs[row]}
        for name, value in example.items():
            if name != "index":
                np.testing.assert_array_equal(value, expected[name], err_msg=name)
    assert set(examples[0]) == {"index", *pairs.column_names, *BATCH_STRUCTURE_KEYS}


def test_length_grouped_sampler_reduces_padding_and_is_reproducible(cache_dir):
    dataset = ExampleDataset(load_records(TRAIN, cache_dir=cache_dir))
    sampler = LengthGroupedSampler(dataset.lengths, batch_size=8, seed=0)
    order = list(sampler)
    assert sorted(order) == list(range(len(dataset)))
    assert list(sampler) == order
    sampler.set_epoch(1)
    assert list(sampler) != order

    def padding(indices):
        chunks = [dataset.lengths[indices[i : i + 8]] for i in range(0, len(indices), 8)]
        return sum(int(c.max() * len(c) - c.sum()) for c in chunks)

    random_order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).numpy()
    assert padding(np.array(order)) < padding(random_order) / 2


# ---- errors: one line each, naming the file, the record and what is wrong ----


def bad(tmp_path, rows, cache_dir) -> str:
    with pytest.raises(DataError) as err:
        load_records(write_jsonl(tmp_path / "bad.jsonl", rows), cache_dir=cache_dir)
    return str(err.value)


def test_wrong_length_names_record_file_chains_and_lengths(tmp_path, cache_dir):
    row = absolute(records()[:1])[0]
    message = bad(tmp_path, [row, {**row, "unpreferred_seq": row["unpreferred_seq"][:-3]}], cache_dir)
    assert message == (
        f"{tmp_path / 'bad.jsonl'}:2: unpreferred_seq has length 149 but designed chains ['F'] of "
        f"{row['pdb_file']} have 152 residues; give one letter per residue of the designed chains, in chain "
        "order"
    )


def test_every_kind_of_bad_record_is_reported_together(tmp_path, cache_dir):
    row = absolute(records()[:1])[0]
    rows = [
        {**row, "pdb_file": str(tmp_path / "absent.pdb")},
        {**row, "chain_id": "Z"},
        {**row, "preferred_seq": row["preferred_seq"][:-1] + "B"},
        {k: v for k, v in row.items() if k != "unpreferred_seq"},
        {**row, "mutable_positions": [200]},
        {**row, "weight": -1},
        row,
    ]
    lines = bad(tmp_path, rows, cache_dir).splitlines()
    file = tmp_path / "bad.jsonl"
    assert lines == [
        f"{file}:1: structure file not found: {tmp_path / 'absent.pdb'} (a relative path is relative to the "
        "data file's folder)",
        f"{file}:2: {row['pdb_file']}: chain 'Z' not found (chains present: F); fix chain_id, design_chains "
        "or fixed_chains",
        f"{file}:3: preferred_seq has characters outside the 20 amino acids + X: 'B'; write upper-case "
        "one-letter codes",
        f"{file}:4: missing required field unpreferred_seq (alias rejected)",
        f"{file}:5: mutable position 200 outside the designed sequence (0..151)",
        f"{file}:6: weight must be a finite number >= 0, got -1",
    ]


def test_malformed_lines_and_empty_datasets(tmp_path, cache_dir):
    row = json.dumps(absolute(records()[:1])[0])
    path = tmp_path / "broken.jsonl"
    path.write_text(f'{row}\n\n{row}\n{{"pdb_file": \n[1, 2]\n')
    with pytest.raises(DataError) as err:
        load_records(path, cache_dir=cache_dir)
    assert str(err.value).splitlines() == [
        f"{path}:4: malformed JSON (Expecting value at column 14); fix the line",
        f"{path}:5: expected a JSON object, got list; write one object per line",
    ]
    for name, text in (("empty.jsonl", ""), ("empty.json", "[]"), ("blank.jsonl", "\n\n"), ("empty.csv", "")):
        (tmp_path / name).write_text(text)
        with pytest.raises(DataError, match=rf"{name}: (empty dataset \(no records\)|cannot read csv)"):
            load_records(tmp_path / name, cache_dir=cache_dir)
    with pytest.raises(DataError, match=r"absent\.jsonl: data file not found"):
        load_records(tmp_path / "absent.jsonl", cache_dir=cache_dir)


def test_json_list_and_csv_problems_name_the_record_or_line(tmp_path, cache_dir):
    row = absolute(records()[:1])[0]
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps([row, "not an object", {**row, "preferred_seq": "ACD"}]))
    with pytest.raises(DataError) as err:
        load_records(path, cache_dir=cache_dir)
    assert str(err.value).splitlines()[0] == f"{path} record 1: expected a JSON object, got str"
    assert str(err.value).splitlines()[1].startswith(f"{path} record 2: preferred_seq has length 3")
    path.write_text(json.dumps([row]).replace('"chain_id"', '"pdb_file": "x.pdb", "chain_id"'))
    with pytest.raises(DataError, match=rf"^{path}: duplicate key 'pdb_file' in one object"):
        load_records(path, cache_dir=cache_dir)
    csv = tmp_path / "pairs.csv"
    csv.write_text("pdb_file,preferred_seq,preferred_seq\na.pdb,A,A\n")
    with pytest.raises(DataError, match=rf"^{csv}:1: duplicate column 'preferred_seq'$"):
        load_records(csv, cache_dir=cache_dir)
    csv.write_bytes(b"pdb_file,preferred_seq,unpreferred_seq\na.pdb,A,A\nb\xff.pdb,A,A\n")
    with pytest.raises(DataError, match=rf"^{csv}:3: not UTF-8 text \(byte 0xff at column 2\)"):
        load_records(csv, cache_dir=cache_dir)


def test_reading_a_table_from_python_draws_no_progress_bar(tmp_path, capfd):
    path = tmp_path / "measured.csv"
    path.write_text("mutant,DMS_score\nA1C,0.5\nA1D,-0.2\n")
    assert [r.data["DMS_score"] for r in read_records(str(path))] == [0.5, -0.2]
    assert datasets.is_progress_bar_enabled()  # left as it was
    captured = capfd.readouterr()
    assert "Generating" not in captured.err + captured.out


def test_many_bad_records_are_reported_together_up_to_a_limit(tmp_path, cache_dir):
    row = absolute(records()[:1])[0]
    message = bad(tmp_path, [row] + [{**row, "preferred_seq": "ACD"}] * 25, cache_dir)
    lines = message.splitlines()
    assert len(lines) == 21 and lines[-1] == "... and 5 more bad records"


def test_a_field_every_record_lacks_is_one_line(tmp_path, cache_dir):
    """A ProteinGym scan without pdb_file: one line naming the field, not one per record."""
    scan = tmp_path / "scan.csv"
    scan.write_text("mutant,sequence,DMS_score\n" + "".join(f"A{i}G,ACDE,{i}\n" for i in range(1, 30)))
    with pytest.raises(DataError) as err:
        load_records(scan, cache_dir=cache_dir, kind=VARIANTS)
    assert str(err.value) == (
        f"{scan}: every one of its 29 records: missing required field pdb_file (alias structure): the "
        "structure file's path; for a file that names none (ProteinGym's layout), give it once: --structure "
        "FILE [--chain_id A] or --proteingym_reference reference.csv"
    )
