"""Prompt datasets on disk in the recipe's layout: where each task's files live, and preparing them
(downloaded from the Hugging Face Hub, imported from local files, or generated).

Layout under ``--data-dir D`` (as the recipe's ``prepare-data`` leaves it, ``hf download --local-dir``):

    D/dapo-math-17k/dapo-math-17k.jsonl    train, task dapo-math          (zhuzilin/dapo-math-17k)
    D/aime-2024/aime-2024.jsonl            eval "aime", task dapo-math    (zhuzilin/aime-2024)
    D/gsm8k/{train,test}.parquet           task gsm8k                     (zhuzilin/gsm8k)
    D/gsm8k/{train,test}.jsonl             written here from the parquet files, so training never needs pyarrow
    D/arith/{train,eval}.jsonl             the generated smoke task (k3.rl.data.arith), no download

Every file is validated before it is put in place (``k3.rl.data.records`` reads records).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import HfHubHTTPError

from k3.rl.data.arith import write_arith_dataset
from k3.rl.data.records import DataError, read_records, write_records

__all__ = ["DATASETS", "TASKS", "DataFile", "HubDataset", "PreparedData", "PreparedFile", "TaskData", "TaskPaths",
           "prepare_data", "task_paths"]


@dataclass(frozen=True)
class DataFile:
    """One prepared jsonl file and the source names it can come from, in order of preference."""

    name: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class HubDataset:
    repo_id: str
    local_name: str  # the folder under the data dir
    files: tuple[DataFile, ...]

    @property
    def url(self) -> str:
        return f"https://huggingface.co/datasets/{self.repo_id}"


DATASETS: dict[str, HubDataset] = {
    "dapo-math-17k": HubDataset(
        "zhuzilin/dapo-math-17k",
        "dapo-math-17k",
        (DataFile("dapo-math-17k.jsonl", ("dapo-math-17k.jsonl", "dapo-math-17k.parquet")),),
    ),
    "aime-2024": HubDataset(
        "zhuzilin/aime-2024",
        "aime-2024",
        (DataFile("aime-2024.jsonl", ("aime-2024.jsonl", "aime-2024.parquet")),),
    ),
    "gsm8k": HubDataset(
        "zhuzilin/gsm8k",
        "gsm8k",
        (
            DataFile("train.jsonl", ("train.parquet", "train.jsonl")),
            DataFile("test.jsonl", ("test.parquet", "test.jsonl")),
        ),
    ),
}


@dataclass(frozen=True)
class TaskData:
    """Where a task's train and eval prompts live, relative to the data dir, and the eval's metric name."""

    datasets: tuple[str, ...]  # keys of DATASETS to fetch; empty for a generated task
    train: str
    eval: str
    eval_name: str  # metrics are logged as eval/<eval_name>


TASKS: dict[str, TaskData] = {
    "dapo-math": TaskData(
        ("dapo-math-17k", "aime-2024"), "dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl", "aime"
    ),
    "gsm8k": TaskData(("gsm8k",), "gsm8k/train.jsonl", "gsm8k/test.jsonl", "gsm8k"),
    "arith": TaskData((), "arith/train.jsonl", "arith/eval.jsonl", "arith"),
}


@dataclass(frozen=True)
class TaskPaths:
    train: Path
    eval: Path
    eval_name: str


def _task(task: str) -> TaskData:
    try:
        return TASKS[task]
    except KeyError:
        raise DataError(f"unknown task {task!r}; expected one of {sorted(TASKS)}") from None


def task_paths(task: str, data_dir: str | Path) -> TaskPaths:
    """The train file, eval file and eval metric name of ``task`` under ``data_dir`` (they may not exist yet)."""
    t = _task(task)
    d = Path(data_dir)
    return TaskPaths(d / t.train, d / t.eval, t.eval_name)


# ---------------------------------------------------------------------------------------------------------
# Preparing a data dir


@dataclass
class PreparedFile:
    path: Path
    records: int
    source: str  # where it came from: "present", "hub", or the imported file


@dataclass
class PreparedData:
    task: str
    paths: TaskPaths
    files: list[PreparedFile] = field(default_factory=list)


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _find_source(root: Path, ds: HubDataset, df: DataFile) -> Path | None:
    """The first candidate source of ``df`` under ``root``: root/name, root/<local_name>/name, then anywhere."""
    for name in df.sources:
        for cand in (root / name, root / ds.local_name / name):
            if cand.is_file():
                return cand
    for name in df.sources:
        hits = sorted(p for p in root.rglob(name) if p.is_file() and ".cache" not in p.parts)
        if hits:
            return hits[0]
    return None


def _offline_help(task: str, data_dir: Path, datasets: Sequence[HubDataset], err: Exception) -> str:
    fetch = "\n".join(
        f"       hf download --repo-type dataset {ds.repo_id} --local-dir {ds.local_name}    ({ds.url})"
        for ds in datasets
    )
    place = "\n".join(f"       {data_dir / ds.local_name / df.name}" for ds in datasets for df in ds.files)
    return (
        f"cannot download {', '.join(ds.repo_id for ds in datasets)} from the Hugging Face Hub "
        f"({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}).\n"
        "Without network, fetch the files on a machine that has it:\n"
        f"{fetch}\n"
        "  then either copy them into place (jsonl with keys prompt, label; gsm8k's parquet files are converted):\n"
        f"{place}\n"
        "  or put the downloaded folders (or files) in one folder FOLDER and run\n"
        f"       k3 prepare-data --task {task} --data-dir {data_dir} --from-local FOLDER"
    )


def _download(ds: HubDataset, target: Path, endpoint: str | None, help_text: Callable[[Exception], str]) -> None:
    """snapshot_download into ``target``; on failure DataError(help_text(err)) says how to do without network."""
    try:
        huggingface_hub.snapshot_download(repo_id=ds.repo_id, repo_type="dataset", local_dir=str(target),
                                          endpoint=endpoint)
    except (OSError, HfHubHTTPError, ValueError) as e:  # offline, unreachable, refused, not found
        raise DataError(help_text(e)) from e


def _existing(data_dir: Path, ds: HubDataset) -> list[PreparedFile] | None:
    """The dataset's prepared files if all are there and valid, else None."""
    paths = [data_dir / ds.local_name / df.name for df in ds.files]
    if not all(p.is_file() for p in paths):
        return None
    try:
        return [PreparedFile(p, len(read_records(p)), "present") for p in paths]
    except DataError as e:
        raise DataError(f"{e}\n(this file is already in place: fix it, or fetch it again with --force)") from e


def prepare_data(
    task: str,
    data_dir: str | Path,
    from_local: str | Path | None = None,
    *,
    force: bool = False,
    endpoint: str | None = None,
    seed: int = 0,
) -> PreparedData:
    """Put ``task``'s train and eval prompts under ``data_dir`` in the recipe's layout.

    Datasets already prepared (all files present and valid) are kept unless ``force``. Otherwise they are
    imported from ``from_local`` (a folder holding the files, e.g. earlier ``hf download`` folders) or
    downloaded with ``huggingface_hub.snapshot_download`` (``endpoint`` overrides ``HF_ENDPOINT``). The generated
    ``arith`` task is written from ``seed``. Files are validated before they are put in place; a failure
    leaves what was there untouched and raises DataError saying what to fetch and where to put it.
    """
    t = _task(task)
    data_dir = Path(data_dir)
    result = PreparedData(task, task_paths(task, data_dir))
    if not t.datasets:
        train, eval_ = write_arith_dataset(data_dir / "arith", seed=seed)
        result.files = [PreparedFile(p, len(read_records(p)), f"generated (seed {seed})") for p in (train, eval_)]
        return result
    local = Path(from_local) if from_local is not None else None
    if local is not None and not local.exists():
        raise DataError(f"--from-local {local}: no such file or folder")
    datasets = [DATASETS[name] for name in t.datasets]
    # Locate (or download) every source first, then validate all, then install: a bad or missing file
    # anywhere leaves the data dir as it was.
    planned: list[tuple[HubDataset, DataFile, Path, str]] = []
    for ds in datasets:
        if not force and (present := _existing(data_dir, ds)) is not None:
            result.files.extend(present)
            continue
        if local is not None:
            root = local if local.is_dir() else local.parent
            for df in ds.files:
                src = local if local.is_file() and local.name in df.sources else _find_source(root, ds, df)
                if src is None:
                    raise DataError(
                        f"--from-local {local}: no {' or '.join(df.sources)} for {ds.repo_id} (looked in {root}, "
                        f"{root / ds.local_name} and below); get it with "
                        f"`hf download --repo-type dataset {ds.repo_id} --local-dir {ds.local_name}` ({ds.url})"
                    )
                planned.append((ds, df, src, str(src)))
        else:
            target = data_dir / ds.local_name
            _download(ds, target, endpoint, lambda err: _offline_help(task, data_dir, datasets, err))
            for df in ds.files:
                src = _find_source(target, ds, df)
                if src is None:
                    raise DataError(f"{ds.repo_id} was downloaded to {target} but has none of {list(df.sources)}")
                planned.append((ds, df, src, "hub"))
    validated = [(ds, df, src, origin, read_records(src)) for ds, df, src, origin in planned]
    for ds, df, src, origin, records in validated:
        target = data_dir / ds.local_name
        dst = target / df.name
        if src.suffix == ".parquet":
            write_records(dst, records)
            kept = target / src.name
            if kept.resolve() != src.resolve():
                _copy_atomic(src, kept)  # keep the recipe's own parquet layout next to the jsonl
        elif src.resolve() != dst.resolve():
            _copy_atomic(src, dst)  # jsonl: byte for byte, extra keys and all
        result.files.append(PreparedFile(dst, len(records), origin))
    return result
