"""Where model and LoRA adapter files come from: a local folder, or an object-store
prefix (``s3://bucket/prefix``) copied once per node into the local cache.

On a multi-node cluster nothing copies folders between nodes, so a local path must exist
on every node that loads it. An ``s3://`` source needs nothing on the node: the first
process that wants it there downloads the prefix's objects into
``<cache>/s3/<bucket>/<prefix, slashes quoted>`` (as Ray Serve LLM does with an S3 ``model_source``).

- **One download per node.** Downloads run under an exclusive ``fcntl`` lock on a file
  of ``<cache>/.locks``, so concurrent replicas on one node download once; the others
  wait, then find the copy complete.
- **Atomic.** Objects go into a temporary folder next to the target, which is renamed
  into place only after every file arrived with its listed size and the marker
  (``kvroute_source.json``: the URI and every object's size and ETag) was written. A
  crash leaves a temp folder, never a half copy under the target name.
- **Reused while current.** Every resolve lists the prefix (one request) and compares
  the sizes and ETags with the marker: an unchanged copy is used as is, a changed one is
  downloaded again. When the object store cannot be reached, a complete copy is used
  (with a warning), so a node that has one keeps serving.
- **S3-compatible servers** (MinIO, Ceph, a GCS bucket through its S3 interoperability
  endpoint): boto3 reads the standard ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``)
  and credentials from the usual places (``AWS_ACCESS_KEY_ID`` …, ``~/.aws``, an
  instance role). Without credentials requests go unsigned (public buckets).

The cache root is ``$KVROUTE_CACHE`` (default ``~/.cache/kvroute``); it also holds the
converted embedded models and the native CPU kernels. Everything missing is a
:class:`SourceNotFoundError` naming the source and this node, because on a cluster "not
found" usually means "not on *this* node". boto3 is imported only for ``s3://`` sources.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Iterator
from urllib.parse import quote

log = logging.getLogger(__name__)

SUPPORTED_SCHEMES = ("s3",)
SOURCE_MARKER = "kvroute_source.json"  # written last into a complete copy
_MARKER_FORMAT = 1
NOT_FOUND = "not found on node"  # in every SourceNotFoundError (it survives Ray's error wrapping as text)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


class SourceNotFoundError(ValueError):
    """A model or adapter source that does not exist as seen from this node."""


def cache_dir() -> Path:
    """kvroute's cache root: ``$KVROUTE_CACHE`` if set, else ``~/.cache/kvroute`` (not created here).

    ``KVROUTE_CACHE_DIR`` (the old name the CPU kernels read) still works when
    ``KVROUTE_CACHE`` is unset, with a DeprecationWarning: dropping it would silently
    move the cache of anyone who set it (e.g. off a read-only home).
    """
    env = os.environ.get("KVROUTE_CACHE")
    if not env and os.environ.get("KVROUTE_CACHE_DIR"):
        env = os.environ["KVROUTE_CACHE_DIR"]
        warnings.warn("KVROUTE_CACHE_DIR is deprecated; set KVROUTE_CACHE", DeprecationWarning, stacklevel=2)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvroute"


def node_name() -> str:
    """This machine's name, as errors show it (replica/ does not import Ray, so no node IP)."""
    return socket.gethostname()


def not_found(what: str, where: str, hint: str) -> SourceNotFoundError:
    """``"<what> <where> not found on node <host> (<hint>)"``."""
    return SourceNotFoundError(f"{what} {where} {NOT_FOUND} {node_name()} ({hint})")


def is_uri(source: str | os.PathLike) -> bool:
    return "://" in str(source)


def parse_uri(uri: str) -> tuple[str, str, str]:
    """``(scheme, bucket, prefix)`` of ``scheme://bucket/prefix`` (prefix without slashes
    at either end). ValueError for an unsupported scheme, no bucket, or a prefix with
    ``.``/``..`` components (it becomes a path in the cache)."""
    scheme, _, rest = str(uri).partition("://")
    scheme = scheme.lower()
    if scheme not in SUPPORTED_SCHEMES:
        raise ValueError(
            f"{uri!r}: unsupported scheme {scheme + '://'!r}; supported: local paths and "
            f"{', '.join(s + '://' for s in SUPPORTED_SCHEMES)} (for a GCS bucket use s3:// with "
            "AWS_ENDPOINT_URL=https://storage.googleapis.com and HMAC keys)"
        )
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket or any(part in ("", ".", "..") for part in prefix.split("/") if prefix):
        raise ValueError(f"{uri!r} is not a valid {scheme}://bucket/prefix URI")
    return scheme, bucket, prefix


@contextmanager
def node_lock(root: Path, name: str) -> Iterator[None]:
    """Hold the exclusive lock ``<root>/.locks/<name>.lock`` (every process of this node
    that opens it, threads included, waits; the kernel drops it if its holder dies)."""
    locks = root / ".locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the cache {root} ({e}); set KVROUTE_CACHE to a writable folder") from e
    with open(locks / f"{name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch(uri: str, what: str, weights: bool = True) -> Path:
    """The local copy of every object under ``uri`` (``s3://bucket/prefix``), downloaded
    first if this node has no current copy. ``what`` names the source in errors ("model
    folder", "LoRA adapter 'x' folder"). ``weights=False`` leaves weight files
    (``*.safetensors`` …) out, for a process that needs only config and tokenizer (a
    complete copy is used if there is one).

    Raises SourceNotFoundError when the bucket does not exist or holds no object under
    the prefix, ValueError when the store refuses or cannot be reached (and there is no
    complete copy).
    """
    scheme, bucket, prefix = parse_uri(uri)
    root = cache_dir()
    target = root / scheme / bucket / _folder_name(prefix)
    uri = f"{scheme}://{bucket}/{prefix}"
    client = _s3_client()
    endpoint = client.meta.endpoint_url
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        objects = _list(client, bucket, prefix)
    except (BotoCoreError, ClientError) as e:  # the store unreachable or refusing: a complete copy still serves
        for copy in (target, target.with_name(target.name + ".no-weights"))[: 1 if weights else 2]:
            if _read_marker(copy) is not None:
                log.warning("cannot list %s (%s); using the copy in %s", uri, e, copy)
                return copy
        raise ValueError(f"cannot list {uri} at {endpoint} from node {node_name()}: {e}") from e
    if objects is None:
        raise not_found(what, uri, f"no bucket {bucket!r} at {endpoint}")
    if not objects:
        raise not_found(what, uri, f"no object under s3://{bucket}/{prefix + '/' if prefix else ''} at {endpoint}")
    if _read_marker(target) == objects:  # the fast path: current and complete
        return target
    if not weights:
        target = target.with_name(target.name + ".no-weights")
        objects = {rel: meta for rel, meta in objects.items() if not rel.endswith(_WEIGHT_SUFFIXES)}
        if _read_marker(target) == objects:
            return target
    lock = hashlib.sha256(str(target).encode()).hexdigest()[:24]
    with node_lock(root, lock):
        if _read_marker(target) != objects:  # re-check: another process may just have finished
            _download(client, uri, bucket, prefix, objects, target)
    return target


def _folder_name(prefix: str) -> str:
    """One folder per prefix, flat (``a/b`` is ``a%2Fb``), so that the copy of a prefix
    never sits inside the copy of its parent prefix (whose swap would delete it)."""
    name = quote(prefix, safe="") or "_"
    return name if len(name) <= 200 else name[:150] + "-" + hashlib.sha256(prefix.encode()).hexdigest()[:24]


def _s3_client() -> Any:
    try:
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config
    except ImportError:
        raise ValueError("s3:// sources need boto3: pip install 'kvroute[serve]'") from None
    session = boto3.session.Session()  # one per call: boto3's default session is not thread-safe
    signed = session.get_credentials() is not None
    # Retries, timeouts, region: boto3's defaults and variables (AWS_MAX_ATTEMPTS, AWS_RETRY_MODE …).
    return session.client("s3", config=None if signed else Config(signature_version=UNSIGNED))


def _list(client: Any, bucket: str, prefix: str) -> dict[str, list] | None:
    """``{relative path: [size, etag]}`` of the objects under the prefix; None when the
    bucket does not exist. Keys that are folder placeholders or our marker are skipped;
    a key that would leave the folder (``..``) is a ValueError."""
    from botocore.exceptions import ClientError

    start = prefix + "/" if prefix else ""
    objects: dict[str, list] = {}
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=start):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(start):]
                if not rel or rel.endswith("/") or rel == SOURCE_MARKER:
                    continue
                if any(part in ("", ".", "..") for part in PurePosixPath(rel).parts) or rel.startswith("/"):
                    raise ValueError(f"s3://{bucket}/{obj['Key']}: the key is not a plain relative path")
                objects[rel] = [int(obj["Size"]), str(obj.get("ETag", "")).strip('"')]
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "NoSuchBucket":
            return None
        raise
    return dict(sorted(objects.items()))


def _read_marker(folder: Path) -> dict[str, list] | None:
    """The objects a complete copy holds (None: no complete copy there)."""
    try:
        marker = json.loads((folder / SOURCE_MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != _MARKER_FORMAT:
        return None
    return marker.get("objects")


def _download(client: Any, uri: str, bucket: str, prefix: str, objects: dict[str, list], target: Path) -> None:
    """Download ``objects`` into a temp folder beside ``target``, then swap it in."""
    from boto3.s3.transfer import TransferConfig

    total = sum(size for size, _ in objects.values())
    print(f"kvroute: fetching {uri} ({len(objects)} files, {total / 2**20:.1f} MiB) into {target} on node "
          f"{node_name()}…", file=sys.stderr, flush=True)  # fmt: skip
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    start = prefix + "/" if prefix else ""
    transfer = TransferConfig(multipart_threshold=64 * 2**20, multipart_chunksize=64 * 2**20)
    try:
        for rel, (size, _) in objects.items():
            dest = tmp / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, start + rel, str(dest), Config=transfer)
            if dest.stat().st_size != size:
                raise ValueError(f"{uri}/{rel}: got {dest.stat().st_size} bytes, listed {size} (changed meanwhile?)")
        marker = {"format": _MARKER_FORMAT, "source": uri, "endpoint": client.meta.endpoint_url, "objects": objects}
        (tmp / SOURCE_MARKER).write_text(json.dumps(marker, indent=1), encoding="utf-8")
        _make_readable(tmp)
        if target.exists():  # an outdated or incomplete copy: move it aside atomically, then delete
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            os.replace(target, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    """Ordinary permissions (mkdtemp makes the folder owner-only)."""
    for dirpath, _, files in os.walk(folder):
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
