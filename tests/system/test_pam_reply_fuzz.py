"""The PAM module's reply parser (pam/reply.c) under AddressSanitizer and UBSan, fed hostile replies.

The reply comes from a socket, so it is untrusted input parsed inside every login process. A C
harness (tests/system/pam_fuzz/reply_fuzz.c) links the very parser the module links; a corpus of
truncated, huge, unbalanced, badly escaped, NUL-laden and deeply nested replies goes through it,
and the parsed fields are checked, not only the absence of a crash. With clang, libFuzzer then
mutates that corpus for a bounded number of runs.
"""
from __future__ import annotations

import json
import random
import shutil
import string
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

PAM = REPO / "pam"
HARNESS = Path(__file__).parent / "pam_fuzz" / "reply_fuzz.c"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-g", "-O1"]
SOURCES = [str(PAM / "reply.c"), str(HARNESS)]
DEVICE_CHARACTERS = frozenset(string.ascii_letters + string.digits + "-_,:/.")  # UUIDs, MIG ids, indices
CUDA_CAP, MESSAGE_CAP, ERROR_CAP = 4096, 1024, 512  # struct reply's fields, NUL included

BASE = (b'{"v":1,"ok":true,"cuda_visible_devices":"GPU-0a1b,GPU-2c3d","message":"gpuguard: GPU 3 is yours",'
        b'"session":{"id":[1,2,{"x":"}]"}],"n":null},"extra":[true,false,-1.5e3]}\n')


def reply(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def nested(depth: int) -> bytes:
    return b'{"x":' + b"[" * depth + b"]" * depth + b',"ok":true}'


# name -> (reply, what the parser must make of it: (rc, ok, cuda_truncated, cuda, message, error)
# with None for "anything, as long as nothing is read or written out of bounds").
Expected = tuple[int, int, int, bytes, bytes, bytes] | None
CASES: dict[str, tuple[bytes, Expected]] = {
    "base": (BASE, (0, 1, 0, b"GPU-0a1b,GPU-2c3d", b"gpuguard: GPU 3 is yours", b"")),
    "empty object": (b"{}", (0, 0, 0, b"", b"", b"")),
    "empty": (b"", (-1, 0, 0, b"", b"", b"")),
    "huge cuda": (reply(ok=True, cuda_visible_devices="A" * 100_000), (0, 1, 1, b"A" * (CUDA_CAP - 1), b"", b"")),
    "huge message": (reply(ok=True, message="m" * 100_000), (0, 1, 0, b"", b"m" * (MESSAGE_CAP - 1), b"")),
    "huge error": (reply(ok=False, error="e" * 100_000), (0, 0, 0, b"", b"", b"e" * (ERROR_CAP - 1))),
    "multibyte at the cut": (reply(ok=True, message="é" * 1000), (0, 1, 0, b"", "é".encode() * 511, b"")),
    "long key that starts with ok": (b'{"ok' + b"x" * 40 + b'":true}', (0, 0, 0, b"", b"", b"")),
    "very long unknown key": (b'{"' + b"k" * 70_000 + b'":1,"ok":true}', (0, 1, 0, b"", b"", b"")),
    "unbalanced quote in value": (b'{"ok":true,"message":"abc}', (-1, 1, 0, b"", b"abc}", b"")),
    "unbalanced quote in key": (b'{"ok:true}', (-1, 0, 0, b"", b"", b"")),
    "escaped closing quote": (b'{"message":"\\"}', (-1, 0, 0, b"", b'"}', b"")),
    "unbalanced brackets": (b'{"x":[[[{]]],"ok":true}', (-1, 0, 0, b"", b"", b"")),
    "backslash at the end": (b'{"message":"abc\\', (-1, 0, 0, b"", b"abc", b"")),
    "short unicode escape": (b'{"message":"\\u12"}', (-1, 0, 0, b"", b"", b"")),
    "bad hex": (b'{"message":"\\uZZZZ"}', (-1, 0, 0, b"", b"", b"")),
    "unknown escape": (b'{"message":"\\x41"}', (-1, 0, 0, b"", b"", b"")),
    "surrogate pair": (b'{"ok":true,"message":"\\ud83d\\ude00"}', (0, 1, 0, b"", "😀".encode(), b"")),
    "lone surrogate": (b'{"ok":true,"message":"\\ud83dx"}', (0, 1, 0, b"", b"?x", b"")),
    "escaped NUL ends the string": (b'{"ok":true,"message":"a\\u0000b"}', (0, 1, 0, b"", b"a", b"")),
    "raw NUL after the object": (b'{"ok":true}\0garbage', (0, 1, 0, b"", b"", b"")),
    "raw NUL inside": (b'{"ok":tr\0ue}', (-1, 0, 0, b"", b"", b"")),
    "raw NUL in a string": (b'{"ok":true,"message":"ab\0cd"}', (-1, 1, 0, b"", b"ab", b"")),
    "control character in a string": (b'{"message":"a\x01b"}', (-1, 0, 0, b"", b"a", b"")),
    "controls are made spaces": (b'{"ok":true,"message":"a\\u001b[31m\\u0085z\\t"}',
                                 (0, 1, 0, b"", b"a [31m  z ", b"")),
    "hostile devices kept but not valid": (reply(ok=True, cuda_visible_devices="GPU-1;rm -rf /"), None),
    "32 levels nested": (nested(32), (0, 1, 0, b"", b"", b"")),
    "33 levels nested": (nested(33), (-1, 0, 0, b"", b"", b"")),
    "100000 levels nested": (nested(100_000), (-1, 0, 0, b"", b"", b"")),
    "100000 open objects": (b'{"a":' * 100_000, (-1, 0, 0, b"", b"", b"")),
    "loose number": (b'{"a":-,"ok":true}', None),
    "ok is not a string": (b'{"ok":"true"}', (0, 0, 0, b"", b"", b"")),
    "fields of the wrong type": (b'{"ok":true,"cuda_visible_devices":7,"message":[1],"error":{}}',
                                 (0, 1, 0, b"", b"", b"")),
    "missing colon": (b'{"ok" true}', (-1, 0, 0, b"", b"", b"")),
    "trailing comma": (b'{"ok":true,}', (-1, 1, 0, b"", b"", b"")),
    "not an object": (b'["ok",true]', (-1, 0, 0, b"", b"", b"")),
}


def corpus() -> dict[str, tuple[bytes, Expected]]:
    """CASES, every proper prefix of BASE (a reply cut short: never complete), and seeded random
    mutations of BASE (bytes flipped, dropped, duplicated: anything but out-of-bounds access)."""
    cases = dict(CASES)
    for cut in range(len(BASE) - 1):  # BASE ends "}\n": a cut before the "}" is never an object
        cases[f"cut at {cut}"] = (BASE[:cut], (-1,) + (None,) * 5)  # type: ignore[assignment]
    rng = random.Random(8)
    for i in range(1500):
        data = bytearray(BASE)
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(data))
            what = rng.randrange(3)
            if what == 0:
                data[at] = rng.randrange(256)
            elif what == 1:
                del data[at]
            else:
                data[at:at] = data[at:at + rng.randint(1, 16)]
        cases[f"mutation {i}"] = (bytes(data), None)
    return cases


def build(compiler: str, output: Path, *flags: str) -> Path:
    subprocess.run([compiler, "-std=gnu11", "-Wall", "-Wextra", "-Werror", f"-I{PAM}", *SANITIZE, *flags,
                    *SOURCES, "-o", str(output)], check=True, capture_output=True, text=True)
    return output


@pytest.fixture(scope="module")
def compiler() -> str:
    for name in ("gcc", "clang", "cc"):
        if shutil.which(name):
            return name
    pytest.skip("no C compiler")


def test_hostile_replies_under_address_sanitizer(compiler, tmp_path) -> None:
    harness = build(compiler, tmp_path / "reply_asan")
    cases = corpus()
    directory = tmp_path / "corpus"
    directory.mkdir()
    paths = []
    for i, (data, _) in enumerate(cases.values()):
        paths.append(directory / f"{i:05d}")
        paths[-1].write_bytes(data)
    result = subprocess.run([str(harness), *map(str, paths)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]  # a sanitizer report exits non-zero
    lines = result.stdout.splitlines()
    assert len(lines) == len(cases)
    for (name, (_, expected)), line in zip(cases.items(), lines, strict=True):
        rc, ok, truncated, valid, *strings = line.split()
        cuda, message, error = (b"" if s == "-" else bytes.fromhex(s) for s in strings)
        got = (int(rc), int(ok), int(truncated), cuda, message, error)
        assert got[0] in (0, -1), name
        if expected is not None:
            assert tuple(g for g, e in zip(got, expected, strict=True) if e is not None) == \
                tuple(e for e in expected if e is not None), name
        # Only UUID characters may pass as devices; the sanitized strings hold no controls.
        assert int(valid) == all(chr(c) in DEVICE_CHARACTERS for c in cuda), name
        assert not any(c < 0x20 or c == 0x7F for c in message + error), name


def test_libfuzzer_finds_nothing_in_a_bounded_run(tmp_path) -> None:
    if not shutil.which("clang"):
        pytest.skip("clang is not installed (apt-get install clang): the libFuzzer run needs it; "
                    "the AddressSanitizer corpus test above still ran")
    fuzzer = build("clang", tmp_path / "reply_fuzzer", "-fsanitize=fuzzer", "-DLIBFUZZER")
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    for i, (data, _) in enumerate(CASES.values()):
        (seeds / f"{i:03d}").write_bytes(data[:8192])
    result = subprocess.run([str(fuzzer), "-runs=20000", "-seed=8", "-max_len=8192", str(seeds)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Done 20000 runs" in result.stderr
