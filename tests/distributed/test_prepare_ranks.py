"""Preparation on every rank: each rank tokenizes its share of the files, and what comes out is
what one process writes, on a shared file system or on nodes with disks of their own; ranks
waiting for a slow one never time out."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from kilnrun import free_port, in_process, launch, losses, sets, start
from layouts import layout_sets, train_on

pytestmark = pytest.mark.dist

# At least 1 MiB a shard (data.shard_bytes' least): the corpus below makes three train shards.
SHARD_SETS = ["data.vocab_size=300", "data.shard_bytes=1048576"]


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory) -> Path:
    """About 2.6 MB in three .jsonl files and five .txt files, with a few exact duplicates."""
    out = tmp_path_factory.mktemp("big-corpus")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:150]
    for i, (a, b) in enumerate([(0, 50), (50, 110), (110, 150)]):
        lines = [json.dumps({"text": p.read_text(errors="replace")[:30000]}) for p in stdlib[a:b]]
        (out / f"part{i}.jsonl").write_text("\n".join(lines) + "\n")
    for p in stdlib[:5]:
        (out / f"{p.stem}.txt").write_text(p.read_text(errors="replace")[:5000])
    return out


def prepared_files(cache: Path) -> dict[str, bytes | dict]:
    """Every file under the cache's prepared/ (and tokenizers/), by its path under the cache; a
    manifest read, less the source as it was named (a relative or an absolute path)."""
    files: dict[str, bytes | dict] = {}
    for path in sorted(p for p in cache.rglob("*") if p.is_file()):
        files[path.relative_to(cache).as_posix()] = path.read_bytes()
        if path.name == "manifest.json":
            files[path.relative_to(cache).as_posix()] = {**json.loads(path.read_text()), "source": None}
    return files


@pytest.fixture(scope="module")
def one_process(big_corpus, tmp_path_factory) -> dict[str, bytes]:
    cache = tmp_path_factory.mktemp("one-process-cache")
    in_process("prepare", *sets([f"data.source={big_corpus}", f"data.cache_dir={cache}", *SHARD_SETS]))
    files = prepared_files(cache)
    assert sum(name.endswith(".bin") and "/train-" in name for name in files) >= 3
    return files


def test_two_ranks_prepare_byte_for_byte_what_one_process_prepares(tmp_path, big_corpus, one_process):
    cache = tmp_path / "cache"
    proc = launch(2, "prepare", *sets([f"data.source={big_corpus}", f"data.cache_dir={cache}", *SHARD_SETS]))
    assert "on each of 2 ranks" in proc.stderr
    assert prepared_files(cache) == one_process  # the manifest, the shards and the tokenizer


def two_nodes(tmp_path: Path, corpus: Path, *missing: str) -> list[tuple[int, str]]:
    """``kiln launch -- prepare`` as two nodes of one rank each, each in a directory of its own
    (its own copy of the corpus, its own cache: no shared file system), run to the end; each
    node's exit status and stderr. The second node's corpus lacks the files named ``missing``."""
    port = free_port()
    procs = []
    for node in (0, 1):
        home = tmp_path / f"node{node}"
        home.mkdir()
        (home / "corpus").mkdir()
        for f in corpus.iterdir():
            (home / "corpus" / f.name).write_bytes(f.read_bytes())
        if node == 1:
            for name in missing:
                (home / "corpus" / name).unlink()
        args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        prepare = sets(["data.source=corpus", "data.cache_dir=cache", *SHARD_SETS])
        procs.append(start("launch", *args, "--", "prepare", *prepare, cwd=home))
    errors = [proc.communicate(timeout=300)[1] for proc in procs]
    return [(proc.returncode, err) for proc, err in zip(procs, errors, strict=True)]


@pytest.mark.slow
def test_nodes_without_a_shared_file_system_each_get_what_one_process_prepares(tmp_path, big_corpus, one_process):
    nodes = two_nodes(tmp_path, big_corpus)
    assert [code for code, _ in nodes] == [0, 0], nodes[0][1][-2000:] + "\n--- node 1 ---\n" + nodes[1][1][-3000:]
    for node in (0, 1):
        assert prepared_files(tmp_path / f"node{node}" / "cache") == one_process


def test_a_file_missing_on_one_node_is_named_and_nothing_is_prepared(tmp_path, big_corpus):
    nodes = two_nodes(tmp_path, big_corpus, "part1.jsonl")
    assert [code for code, _ in nodes] == [2, 2]
    for _, err in nodes:
        assert "does not see the same files as rank 0" in err and "part1.jsonl is missing there" in err, err[-2000:]
    assert not (tmp_path / "node0" / "cache").exists() and not (tmp_path / "node1" / "cache").exists()


@pytest.mark.slow
def test_a_preparation_longer_than_the_collective_timeout_does_not_time_out(tmp_path, corpus_dir):
    """With parallel.init_timeout=1s the process group gives up on a collective after 16.2 s
    (the watchdog's limit, tick and grace, and 10 s); rank 0 tokenizes for 18 s more than it
    needs, while rank 1 meets it every 2 s."""
    run_dir = tmp_path / "run"
    sets = layout_sets(
        run_dir,
        corpus_dir,
        micro=2,
        train__max_steps=2,
        parallel__init_timeout="1s",
        debug__slow_prepare_seconds=18,
        data__cache_dir=tmp_path / "cache",  # a cache of its own: the preparation happens here
    )
    proc = train_on(2, sets)
    assert sorted(losses(run_dir)) == [1, 2], proc.stderr[-2000:]
    assert "tokenizing 38 train documents" in proc.stderr or "kiln: tokenized train" in proc.stderr


def test_kiln_launch_prepare_prepares_once(tmp_path, corpus_dir):
    cache = tmp_path / "cache"
    proc = launch(2, "prepare", *sets([f"data.source={corpus_dir}", "data.vocab_size=300", f"data.cache_dir={cache}"]))
    assert proc.stdout.count("kiln: tokenized") == 1
    assert len(list((cache / "prepared").iterdir())) == 1
