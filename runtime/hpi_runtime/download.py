"""Fetch a Hugging Face checkpoint into a directory: only the files the loader reads, each verified, resumable.

The operator's model-cache Job (and, for node-local caches, an init container) runs this module from the
runtime image; `hpi serve <org/name>` uses it through `llm.download_from_hub`.

- What to fetch: the configs, tokenizer and chat template first, then only the shards the loader reads
  (`model.loader.weight_file_patterns`: the index's weight_map, else `model*.safetensors`), never e.g.
  Mistral's `consolidated.safetensors` copy. A PEFT LoRA adapter (`--adapter`): its adapter_config.json and
  adapter_model.safetensors.
- Verified against the hub's metadata (`/api/models/<id>/revision/<rev>?blobs=true`): every file's size, and
  its sha256 (LFS files: the weights) or git blob id (small files). A mismatch deletes the partial file and
  fails; nothing is ever left at its final name unverified.
- Resumable: bytes land in `<dir>/.hpi-download/<name>.part` and move to `<dir>/<name>` once verified; a
  connection dropped mid-file is resumed with a Range request (a few times per run), and a run that was
  killed resumes the same way when started again (the Job's next pod, the next init container).
- Complete means the marker `<dir>/.hpi-complete.json` exists, written last, listing every file and its size:
  pods refuse a directory without it (`check`), so no replica starts on a partial cache.
- One writer per directory at a time (an flock), for node-local caches that several pods fill at once.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any
from urllib.parse import quote

LOG = logging.getLogger("hpi_runtime.download")

# Everything but the weights that the runtime needs: configs (and the shard index), tokenizer, template.
HUB_METADATA_PATTERNS = ("*.json", "tokenizer*", "*.jinja")
ADAPTER_WEIGHT_PATTERNS = ("adapter_model.safetensors",)  # PEFT's file (its .bin form is not read: pickle)
MARKER_FILE = ".hpi-complete.json"
WORK_DIR = ".hpi-download"
CHUNK_BYTES = 1 << 20
NUM_TRANSFER_TRIES = 4  # per file and run: a dropped connection resumes where it stopped
RETRY_BASE_DELAY_S = 1.0
PROGRESS_LOG_INTERVAL_S = 15.0


class DownloadError(RuntimeError):
    """The hub's bytes do not match its metadata, or the hub kept failing; the message says which file."""


@dataclass(frozen=True)
class HubFile:
    """One file of a repo revision, as the hub describes it."""

    name: str  # path inside the repo
    size: int
    sha256: str | None = None  # LFS files
    git_oid: str | None = None  # every file: the git blob id (sha1 of "blob <size>\0" + content)


@dataclass(frozen=True)
class Snapshot:
    repo_id: str
    revision: str  # as asked (a branch, tag or commit)
    commit: str  # what it resolved to: every file is fetched at this commit
    files: tuple[HubFile, ...]

    def select(self, patterns: Iterable[str]) -> list[HubFile]:
        patterns = list(patterns)
        return [f for f in self.files if any(fnmatch(f.name, p) for p in patterns)]


@dataclass(frozen=True)
class DownloadResult:
    local_dir: Path
    commit: str
    files: tuple[HubFile, ...]
    num_fetched_bytes: int  # bytes transferred by this run (0 when everything was already there)

    @property
    def num_bytes(self) -> int:
        return sum(f.size for f in self.files)


def read_snapshot(
    repo_id: str, revision: str = "main", token: str | None = None, endpoint: str | None = None
) -> Snapshot:
    """The hub's file list for `repo_id` at `revision`, with sizes and hashes."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision, files_metadata=True)
    files = []
    for sibling in info.siblings or []:
        if sibling.size is None:
            raise DownloadError(f"the hub gave no size for {repo_id}/{sibling.rfilename}: cannot verify it")
        files.append(HubFile(
            name=sibling.rfilename,
            size=sibling.size,
            sha256=sibling.lfs.sha256 if sibling.lfs else None,
            git_oid=sibling.blob_id,
        ))  # fmt: skip
    return Snapshot(repo_id=repo_id, revision=revision, commit=info.sha or revision, files=tuple(files))


def _hasher(hub_file: HubFile) -> tuple[Any, str | None]:
    if hub_file.sha256:
        return hashlib.sha256(), hub_file.sha256
    digest = hashlib.sha1(usedforsecurity=False)  # git's blob id
    digest.update(f"blob {hub_file.size}\0".encode())
    return digest, hub_file.git_oid


def _safe_target(local_dir: Path, name: str) -> Path:
    target = (local_dir / name).resolve()
    if local_dir.resolve() not in target.parents:
        raise DownloadError(f"refusing repo path {name!r}: it points outside {local_dir}")
    return target


def fetch_file(session: Any, url: str, headers: dict[str, str], local_dir: Path, hub_file: HubFile) -> int:
    """Bring `local_dir/<name>` to the hub's verified bytes; returns how many bytes were missing before.

    A file already at its final name has been verified before it was moved there: only its size is checked.
    """
    target = _safe_target(local_dir, hub_file.name)
    if target.is_file() and target.stat().st_size == hub_file.size:
        return 0
    part = local_dir / WORK_DIR / f"{hub_file.name}.part"
    part.parent.mkdir(parents=True, exist_ok=True)
    had = part.stat().st_size if part.is_file() else 0
    missing = hub_file.size - had if had <= hub_file.size else hub_file.size
    for attempt in range(NUM_TRANSFER_TRIES):
        have = part.stat().st_size if part.is_file() else 0
        if have > hub_file.size:
            part.unlink()
            have = 0
        try:
            _transfer(session, url, headers, part, have, hub_file.size)
            break
        except DownloadError:
            raise
        except Exception as e:  # connection reset, timeout, 5xx: resume from what arrived
            if attempt + 1 == NUM_TRANSFER_TRIES:
                raise DownloadError(f"{hub_file.name}: giving up after {NUM_TRANSFER_TRIES} tries: {e}") from e
            delay = RETRY_BASE_DELAY_S * 2**attempt
            LOG.warning("%s: transfer interrupted (%s); resuming in %.0fs", hub_file.name, e, delay)
            time.sleep(delay)
    _verify(part, hub_file)
    target.parent.mkdir(parents=True, exist_ok=True)
    part.replace(target)
    return missing


def _transfer(session: Any, url: str, headers: dict[str, str], part: Path, have: int, size: int) -> None:
    if have == size:
        return
    request_headers = dict(headers)
    if have:
        request_headers["Range"] = f"bytes={have}-"
    with session.stream("GET", url, headers=request_headers, follow_redirects=True, timeout=60) as response:
        if response.status_code in (401, 403, 404):
            raise DownloadError(f"{url}: HTTP {response.status_code} (gated or missing? set HF_TOKEN)")
        response.raise_for_status()
        mode = "ab" if have and response.status_code == 206 else "wb"  # a 200 to a Range request: start over
        done = have if mode == "ab" else 0
        last_log_s = time.monotonic()
        with part.open(mode) as out:
            for chunk in response.iter_bytes():  # as it arrives: a drop loses nothing received
                out.write(chunk)
                done += len(chunk)
                if time.monotonic() - last_log_s >= PROGRESS_LOG_INTERVAL_S:  # `kubectl logs job/...` shows it
                    last_log_s = time.monotonic()
                    LOG.info("%s: %.2f of %.2f GiB (%d%%)", part.name.removesuffix(".part"), done / 2**30,
                             size / 2**30, 100 * done // max(size, 1))  # fmt: skip
    if part.stat().st_size != size:
        raise ConnectionError(f"stream ended at {part.stat().st_size} of {size} bytes")


def _verify(path: Path, hub_file: HubFile) -> None:
    size = path.stat().st_size
    digest, expected = _hasher(hub_file)
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    if size != hub_file.size or (expected and digest.hexdigest() != expected):
        path.unlink()
        kind = "sha256" if hub_file.sha256 else "git blob id"
        raise DownloadError(
            f"{hub_file.name}: {size} bytes with {kind} {digest.hexdigest()}, but the hub lists "
            f"{hub_file.size} bytes with {expected}; the partial file was removed"
        )


@contextlib.contextmanager
def _exclusive(local_dir: Path) -> Iterator[None]:
    lock = local_dir / WORK_DIR / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def is_complete(local_dir: Path) -> bool:
    """True when a download into `local_dir` finished: the marker is there and every file it lists is whole."""
    try:
        marker = json.loads((Path(local_dir) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    files = marker.get("files") or {}
    return bool(files) and all(
        (Path(local_dir) / name).is_file() and (Path(local_dir) / name).stat().st_size == size
        for name, size in files.items()
    )


def weight_files(snapshot: Snapshot, local_dir: Path) -> list[HubFile]:
    """The shards the loader will read, by its own rule, given the already fetched index (if any)."""
    from hpi_runtime.models.loader import INDEX_FILE, weight_file_patterns  # imports torch: only here

    index_path = local_dir / INDEX_FILE
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    patterns = weight_file_patterns(index)
    shards = snapshot.select(patterns)
    listed = {f.name for f in snapshot.files}
    missing = [p for p in patterns if not any(fnmatch(name, p) for name in listed)]
    if missing or not shards:
        raise DownloadError(f"{snapshot.repo_id}@{snapshot.commit} lacks weight files {missing or patterns}")
    return shards


def adapter_files(snapshot: Snapshot) -> list[HubFile]:
    """A PEFT LoRA adapter's weights (its adapter_config.json comes with the metadata)."""
    shards = snapshot.select(ADAPTER_WEIGHT_PATTERNS)
    names = {f.name for f in snapshot.files}
    if not shards or "adapter_config.json" not in names:
        raise DownloadError(f"{snapshot.repo_id}@{snapshot.commit} is not a PEFT adapter: it lacks "
                            f"adapter_config.json or {ADAPTER_WEIGHT_PATTERNS[0]}")  # fmt: skip
    return shards


def download_model(
    repo_id: str,
    local_dir: Path,
    revision: str = "main",
    token: str | None = None,
    endpoint: str | None = None,
    adapter: bool = False,
) -> DownloadResult:
    """Fetch `repo_id` at `revision` into `local_dir` (see the module docstring); idempotent. `adapter`: a PEFT
    LoRA adapter (adapter_config.json and adapter_model.safetensors) rather than a model."""
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session

    endpoint = endpoint or constants.ENDPOINT  # HF_ENDPOINT (a mirror) when set
    local_dir = Path(local_dir)
    local_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(local_dir):
        snapshot = read_snapshot(repo_id, revision, token=token, endpoint=endpoint)
        headers = build_hf_headers(token=token)
        session = get_session()
        fetched = 0
        base_url = f"{endpoint.rstrip('/')}/{repo_id}/resolve/{quote(snapshot.commit, safe='')}"

        def fetch_all(files: Sequence[HubFile]) -> None:
            nonlocal fetched
            for hub_file in files:
                url = f"{base_url}/{quote(hub_file.name)}"
                fetched += fetch_file(session, url, headers, local_dir, hub_file)
                LOG.info("%s: %d bytes verified", hub_file.name, hub_file.size)

        metadata = snapshot.select(HUB_METADATA_PATTERNS)
        fetch_all(metadata)
        shards = adapter_files(snapshot) if adapter else weight_files(snapshot, local_dir)
        fetch_all(shards)
        files = tuple(sorted({f.name: f for f in (*metadata, *shards)}.values(), key=lambda f: f.name))
        marker = {
            "repo": repo_id,
            "revision": revision,
            "commit": snapshot.commit,
            "files": {f.name: f.size for f in files},
        }
        (local_dir / MARKER_FILE).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")
        for stray in (local_dir / WORK_DIR).rglob("*.part"):  # files of an earlier selection
            stray.unlink()
    return DownloadResult(local_dir=local_dir, commit=snapshot.commit, files=files, num_fetched_bytes=fetched)


def remove_download(local_dir: Path) -> bool:
    """Delete a download directory (an old revision); refuses anything this module did not write."""
    local_dir = Path(local_dir)
    if not local_dir.exists():
        return False
    if not ((local_dir / MARKER_FILE).exists() or (local_dir / WORK_DIR).exists()):
        raise DownloadError(f"{local_dir} is not a model download directory; not removing it")
    shutil.rmtree(local_dir)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpi_runtime.download", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("fetch", help="download (or finish downloading) a model into a directory")
    fetch.add_argument("repo_id")
    fetch.add_argument("local_dir", type=Path)
    fetch.add_argument("--revision", default="main")
    fetch.add_argument("--adapter", action="store_true", help="a PEFT LoRA adapter, not a model")
    fetch.add_argument("--termination-log", type=Path, help="write a JSON summary here (Kubernetes reads it)")
    check = commands.add_parser("check", help="exit 0 if the directory holds a complete download, else 1")
    check.add_argument("local_dir", type=Path)
    remove = commands.add_parser("remove", help="delete a download directory (an unused revision)")
    remove.add_argument("local_dir", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    if args.command == "check":
        complete = is_complete(args.local_dir)
        print(f"{args.local_dir}: {'complete' if complete else 'incomplete: no finished download here'}")
        return 0 if complete else 1
    if args.command == "remove":
        print(f"{args.local_dir}: {'removed' if remove_download(args.local_dir) else 'already gone'}")
        return 0
    try:
        result = download_model(args.repo_id, args.local_dir, args.revision, adapter=args.adapter)
    except DownloadError as e:
        summary = {"ok": False, "error": str(e)}
        LOG.error("%s", e)
    else:
        summary = {"ok": True, "commit": result.commit, "files": len(result.files), "bytes": result.num_bytes,
                   "fetchedBytes": result.num_fetched_bytes}  # fmt: skip
    if args.termination_log:
        with contextlib.suppress(OSError):
            args.termination_log.write_text(json.dumps(summary)[:4000])
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
