"""Object-storage URLs (``s3://``, ``gs://``, any fsspec protocol) for checkpoints.

A checkpoint location is either a local folder (a ``Path``) or a URL (a ``str``) that
fsspec opens. Credentials are never part of a plan: each backend reads its own usual
sources (for S3, botocore's ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``
and ``~/.aws``; an S3-compatible server through ``AWS_ENDPOINT_URL``). What a user can get
wrong (the backend's package missing, no credentials, no such bucket, an endpoint that does
not answer) becomes one UserError naming the key and the fix.

This module imports no torch.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

from llmforge.errors import Problem, UserError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
#: The package that brings each common protocol to fsspec, and how to install it.
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}
_INSTALL = {"s3fs": "pip install 'llmforge[s3]' (or pip install s3fs)"}
CREDENTIALS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE with ~/.aws/credentials, or an instance role)",
    "gs": "run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS",
}


#: fsspec protocols that name this machine's own files: a path, not object storage.
LOCAL_PROTOCOLS = frozenset({"file", "local"})
#: fsspec protocols whose files live in the process alone: everything there vanishes at exit.
IN_PROCESS_PROTOCOLS = frozenset({"memory"})
# A URL whose "//" a path library folded into one slash (s3:/bucket/x), or a bare "s3:".
_FOLDED_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(/(?!/)|$)")


def is_url(where: object) -> bool:
    """Whether a location is an object-storage URL (``file://`` and ``local://`` count as local)."""
    if not isinstance(where, str):
        return False
    match = _URL.match(where)
    return bool(match) and match.group(1).lower() not in LOCAL_PROTOCOLS


def not_a_local_path(where: object) -> str | None:
    """Why ``where`` cannot be taken as a local path (None when it can): a URL, even a
    ``file://`` one, or a URL whose ``//`` a path library folded into one slash
    (``s3:/bucket/x``), would become a local folder named after its protocol."""
    if not isinstance(where, str):
        return None
    match = _URL.match(where)
    if match and match.group(1).lower() in LOCAL_PROTOCOLS:
        return f"is a {match.group(1)}:// URL, and a local path is given as the path itself"
    if match:
        return "is a URL, and only checkpoint.dir may be in object storage: this takes a local path"
    return FOLDED_URL_RULE if _FOLDED_URL.match(where) else None


def looks_like_url(where: object) -> bool:
    """Whether ``where`` would be taken for a URL rather than a local path (``not_a_local_path``)."""
    return not_a_local_path(where) is not None


def local_output(where: str | os.PathLike[str], *, key: str, example: str) -> Path:
    """An output the command writes on this machine, as a Path: a URL (or a URL folded into
    ``s3:/...``) is refused rather than written to a local folder named after its protocol."""
    text = os.fspath(where)
    rule = not_a_local_path(text)
    if rule:
        raise UserError(
            [Problem(key, text, rule, f"write it here, e.g. {key} {example}, then copy it to object storage with its own tools")],
            title="cannot write the output",
        )
    return Path(text)


FOLDED_URL_RULE = "is a URL whose '//' was folded into one slash: it would become a local folder of that name"


def url_problem(url: str, *, key: str) -> tuple[str, str] | None:
    """(why, fix) when a URL cannot hold checkpoints: a store that ends with the process, or
    no bucket (``s3://`` alone, which a path join would turn into a local ``s3:/step_N``)."""
    proto = protocol(url)
    if proto in IN_PROCESS_PROTOCOLS:
        return (
            f"{proto}:// keeps its objects in the memory of one process: every checkpoint would vanish when the run ends",
            f"give a persistent store's URL such as s3://BUCKET/PREFIX, or leave {key} unset for run.dir/checkpoints",
        )
    if not bucket(url).strip():
        return f"names no bucket after {proto}://", f"name the bucket and a prefix, e.g. {key}={proto}://BUCKET/PREFIX"
    return None


def protocol(url: str) -> str:
    """``s3`` of ``s3://bucket/x``."""
    return _URL.match(url).group(1).lower()  # type: ignore[union-attr]


def join(url: str, *parts: str) -> str:
    """``url/part/...`` with one slash between parts."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def basename(url: str) -> str:
    """The last part of a URL's path."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def parent(url: str) -> str:
    """The URL one level up."""
    return url.rstrip("/").rsplit("/", 1)[0]


def bucket(url: str) -> str:
    """The bucket (first path part) of a URL."""
    return _URL.match(url).group(2).split("/", 1)[0]  # type: ignore[union-attr]


def filesystem(url: str, *, key: str = "checkpoint.dir") -> Any:
    """The fsspec filesystem of ``url``; a UserError when its package is not installed."""
    import fsspec

    try:
        fs, _ = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        package = PACKAGES.get(protocol(url), str(getattr(exc, "name", "") or "the backend's package"))
        fix = _INSTALL.get(package, f"pip install {package}")
        raise UserError(
            [Problem(key, url, f"{protocol(url)}:// needs the {package} package, which is not installed", fix)],
            title="cannot open object storage",
        ) from None
    except ValueError as exc:
        raise UserError(
            [
                Problem(
                    key, url, f"not a storage URL fsspec knows ({exc})", "use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or another fsspec URL"
                )
            ],
            title="cannot open object storage",
        ) from None
    return fs


def problem(exc: BaseException, *, url: str, key: str = "checkpoint.dir") -> tuple[str, str]:
    """(what went wrong, how to fix it) for a failed request to object storage."""
    name, text = type(exc).__name__, str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    proto = protocol(url)
    if "Credentials" in name or "credentials" in text.lower():
        return (
            f"no credentials were found ({text})",
            f"{CREDENTIALS.get(proto, 'configure the credentials of the ' + proto + ' backend')}; a plan never holds them",
        )
    if "Endpoint" in name or "Connect" in name or isinstance(exc, (ConnectionError, TimeoutError)) or "connect" in text.lower():
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        now = f" (now {endpoint})" if endpoint else " (unset: the provider's own endpoint)"
        return f"the storage endpoint does not answer ({text})", f"check AWS_ENDPOINT_URL{now} for an S3-compatible server, and the network"
    if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in text:
        return f"the bucket {bucket(url)!r} does not exist ({text})", f"create it (e.g. `aws s3 mb {proto}://{bucket(url)}`) or fix {key}"
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return f"access denied ({text})", f"grant these credentials read and write access to {url}"
    return f"{name}: {text}", f"check {key} and the storage's credentials and endpoint"


def storage_error(exc: BaseException, *, url: str, doing: str, key: str = "checkpoint.dir") -> UserError:
    """One UserError for a failed request to object storage while ``doing`` something."""
    why, fix = problem(exc, url=url, key=key)
    return UserError([Problem(key, url, f"cannot {doing}: {why}", fix)], title="object storage failed")


def check_reachable(url: str, *, key: str = "checkpoint.dir") -> None:
    """Before any work: write, read back and delete a small object under ``url``, so missing
    packages, credentials, buckets and endpoints show up now, not at the first save."""
    fs = filesystem(url, key=key)
    _refuse_in_process(fs, url=url, key=key)
    probe = join(url, f".llmforge-probe-{uuid.uuid4().hex[:12]}")
    try:
        fs.pipe_file(probe, b"ok")
        if fs.cat_file(probe) != b"ok":
            raise OSError("a probe object read back different bytes")
        fs.rm_file(probe)
    except UserError:
        raise
    except Exception as exc:  # each backend raises its own types (botocore, aiohttp, google-auth)
        raise storage_error(exc, url=url, doing="write a test object there", key=key) from None


def _refuse_in_process(fs: Any, *, url: str, key: str) -> None:
    """A store held in this process passes any probe and loses everything at exit: whatever
    protocol name a backend registered it under, refuse it."""
    from fsspec.implementations.memory import MemoryFileSystem

    if isinstance(fs, MemoryFileSystem):
        raise UserError(
            [
                Problem(
                    key,
                    url,
                    f"{protocol(url)}:// is a store in the memory of this process: every checkpoint would vanish when the run ends",
                    f"give a persistent store's URL such as s3://BUCKET/PREFIX, or leave {key} unset for run.dir/checkpoints",
                )
            ],
            title="cannot use this storage",
        )
