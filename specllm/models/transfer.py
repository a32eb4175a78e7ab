"""One file over HTTP into `<file>.part`, resuming where an earlier try stopped, then checked.

The part file is kept when the transfer breaks (a dropped connection, Ctrl-C), so the next try asks
for the rest with a Range header; it is deleted when the bytes are wrong (longer than the hub says,
or a checksum that does not match), so a bad file is never resumed, used, or renamed into place.
The HTTP client is handed in (`specllm.models.hub` gives huggingface_hub's, with its proxies), with
the exceptions that mean "the connection broke" for that client.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from specllm.errors import one_line

CHUNK = 1 << 20
RETRIES = 3  # within one run, after a broken transfer; every later run resumes too
RETRY_PAUSE = 0.5  # seconds before the first retry, doubling with each, at most 2 s


class TransferBroken(Exception):
    """The connection failed before the whole file came; the part file is kept for resuming."""


class BadFile(ValueError):
    """The bytes are not the file the hub describes; the part file is gone."""


class HttpRefused(Exception):
    def __init__(self, status: int, url: str):
        super().__init__(f"HTTP {status}")
        self.status, self.url = status, url


def download(
    client,
    url: str,
    headers: dict[str, str],
    part: Path,
    size: int,
    report: Callable[[int], None],
    *,
    timeout: float,
    transient: tuple[type[BaseException], ...],
    retries: int = RETRIES,
) -> None:
    """Fill `part` with the `size` bytes at `url`, resuming from what `part` already holds."""
    failures = 0
    while True:
        have = part.stat().st_size if part.exists() else 0
        if have > size:
            part.unlink()
            raise BadFile(f"got more than {size} bytes")
        if have == size:
            return
        if have and part.stat().st_nlink > 1:
            _own_copy(part)
        try:
            _fetch_rest(client, url, headers, part, have, size, report, timeout)
        except transient as exc:
            failures += 1
            got = part.stat().st_size if part.exists() else 0
            if failures > retries:
                raise TransferBroken(f"broke off after {got} of {size} bytes ({one_line(exc, 200)})") from None
            time.sleep(min(RETRY_PAUSE * 2 ** (failures - 1), 2.0))
            continue
        got = part.stat().st_size if part.exists() else 0
        if got < size:  # the server ended its answer cleanly but short: the file it has is truncated
            part.unlink(missing_ok=True)
            raise BadFile(f"the hub served {got} bytes, its metadata says {size}")


def _own_copy(part: Path) -> None:
    """A part hard-linked from the Hugging Face cache (adopted whole, then found short of a file the hub
    has since changed): appending to it, or rewriting it, would change that cache's file too."""
    copy = part.with_name(part.name + ".copy")
    shutil.copyfile(part, copy)
    os.replace(copy, part)


def _fetch_rest(client, url, headers, part: Path, have: int, size: int, report, timeout: float) -> None:
    request_headers = {**headers, "Accept-Encoding": "identity"}
    if have:
        request_headers["Range"] = f"bytes={have}-"
    with client.stream("GET", url, headers=request_headers, follow_redirects=True, timeout=timeout) as response:
        if response.status_code == 416 and have:  # nothing after `have`: the server's file is that long
            return
        if response.status_code >= 400:
            raise HttpRefused(response.status_code, url)
        resumed = have and response.status_code == 206
        done = have if resumed else 0  # a 200 to a Range request is the whole file again
        with open(part, "ab" if resumed else "wb") as out:
            for chunk in response.iter_bytes():  # as they arrive: a break loses no buffered bytes
                done += len(chunk)
                if done > size:
                    out.close()
                    part.unlink()
                    raise BadFile(f"got more than {size} bytes")
                out.write(chunk)
                report(done)


def check(part: Path, size: int, sha256: str | None, blob_id: str | None, report: Callable[[int], None]) -> str:
    """The part's sha256 when it is the file described (LFS sha256, else the git blob id); else BadFile."""
    got = part.stat().st_size
    if got != size:
        part.unlink()
        raise BadFile(f"got {got} bytes, the hub's metadata says {size}")
    digest, blob, done = hashlib.sha256(), hashlib.sha1(f"blob {size}\0".encode()), 0
    with open(part, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            if sha256 is None:
                blob.update(chunk)
            done += len(chunk)
            report(done)
    if sha256 is not None and digest.hexdigest() != sha256:
        part.unlink()
        raise BadFile(f"sha256 {digest.hexdigest()[:12]}... does not match the hub's LFS metadata ({sha256[:12]}...)")
    if sha256 is None and blob_id is not None and blob.hexdigest() != blob_id:
        part.unlink()
        raise BadFile(f"git blob id {blob.hexdigest()[:12]}... does not match the hub's ({blob_id[:12]}...)")
    return digest.hexdigest()
