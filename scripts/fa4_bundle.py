"""FlashAttention-4 for a GPU machine that cannot reach a package index: one compressed bundle of the
installed files of its wheels, small enough to travel with a checkout, and its installer.

    python scripts/fa4_bundle.py fetch             # pip download the pinned wheels into .whl-fa4/ (here)
    python scripts/fa4_bundle.py build             # -> .carry/fa4/fa4-site.tar.xz + manifest.json (here)
    python scripts/fa4_bundle.py install           # unpack into .carry/fa4-site/ (on the GPU machine)
    eval "$(python scripts/fa4_bundle.py env)"     # PYTHONPATH for it (scripts/device/fa4_env.sh: both)

``flash-attn-4`` is pure Python, but its compiler (``nvidia-cutlass-dsl-libs-cu13``) is a 92 MB wheel of
shared libraries (237 MB unpacked): zip-compressed it does not fit a transfer of 64 MiB with the checkout.
``build`` unpacks every pinned wheel into one tree (what ``pip install --target`` would write: no wheel here
has a ``.data`` directory, none needs a script), drops the Arm and QNX stubs, and writes it as one tar
compressed with xz's x86 branch filter and LZMA2 at preset 9e with a 192 MiB dictionary (~50 MiB; plain
``xz -9e`` gives ~61), then refuses a bundle over ``--limit-mib``. ``install`` checks the bundle's SHA-256
against its manifest and unpacks it once (a marker holds the hash: a second call with the same bundle does
nothing). The cutlass package's ``.pth`` (which puts its ``dsl_packages`` folder on ``sys.path``) is not run
for a folder on PYTHONPATH, so ``env`` names both folders. The GPU image's own einops, typing-extensions,
cuda-bindings and protobuf are used; the CUDA 13 build of the compiler matches its driver (580, CUDA 13.0).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = {  # distribution -> version (pip names)
    "flash-attn-4": "4.0.0b36",
    "nvidia-cutlass-dsl": "4.8.1",
    "nvidia-cutlass-dsl-libs-base": "4.8.1",
    "nvidia-cutlass-dsl-libs-core": "4.8.1",
    "nvidia-cutlass-dsl-libs-cu13": "4.8.1",
    "quack-kernels": "0.6.5",
    "apache-tvm-ffi": "0.1.15.post2",
    "torch-c-dlpack-ext": "0.1.5",
}
DROP = ("/stubs/aarch64-",)  # path parts of files not needed on x86-64
BUNDLE, MANIFEST, MARKER = "fa4-site.tar.xz", "manifest.json", ".bundle-sha256"
DSL_PACKAGES = "nvidia_cutlass_dsl/dsl_packages"
FILTERS = [{"id": lzma.FILTER_X86},
           {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": 192 << 20,
            "nice_len": 273}]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
MIB = 1 << 20


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def find_wheels(folder: Path, pins: dict[str, str] = WHEELS) -> list[Path]:
    """The wheel file of each pinned distribution in ``folder`` (exactly the pinned version), in pin order;
    SystemExit naming every one missing."""
    found, missing = [], []
    for dist, version in pins.items():
        hits = [w for w in sorted(folder.glob("*.whl"))
                if _norm(w.name.split("-")[0]) == _norm(dist) and w.name.split("-")[1] == version]
        (found.append(hits[0]) if hits else missing.append(f"{dist}=={version}"))
    if missing:
        raise SystemExit(f"{folder}: no wheel for {', '.join(missing)} (python scripts/fa4_bundle.py fetch)")
    return found


def _members(wheels: list[Path]):
    """(path, bytes) of every file the wheels install, sorted by path; a path two wheels both hold is an
    error (pip would overwrite one with the other)."""
    files: dict[str, bytes] = {}
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            for info in z.infolist():
                name = info.filename
                if info.is_dir() or any(d in "/" + name for d in DROP):
                    continue
                if name.split("/", 1)[0].endswith(".data"):
                    raise SystemExit(f"{w.name}: has {name}: a .data directory this bundler does not place")
                if name in files:
                    raise SystemExit(f"{w.name}: {name} is in another wheel of the bundle too")
                files[name] = z.read(info)
    return sorted(files.items())


def build(wheels: list[Path], out: Path, limit_mib: float, filters=FILTERS) -> dict:
    """Write ``out/fa4-site.tar.xz`` and ``out/manifest.json``; SystemExit if the bundle is over the limit
    (nothing is left in ``out`` then)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in _members(wheels):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o755 if name.endswith(".so") else 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    packed = lzma.compress(raw.getvalue(), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=filters)
    size_mib = len(packed) / MIB
    if size_mib > limit_mib:
        raise SystemExit(f"bundle is {size_mib:.2f} MiB, over the {limit_mib} MiB limit: not written")
    out.mkdir(parents=True, exist_ok=True)
    (out / BUNDLE).write_bytes(packed)
    manifest = {"sha256": hashlib.sha256(packed).hexdigest(), "bytes": len(packed), "mib": round(size_mib, 2),
                "unpacked_bytes": len(raw.getvalue()), "wheels": [w.name for w in wheels],
                "dsl_packages": DSL_PACKAGES}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def install(bundle_dir: Path, site: Path) -> str:
    """Unpack the bundle into ``site`` unless its marker already names this bundle; returns what it did."""
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    if (site / MARKER).is_file() and (site / MARKER).read_text().strip() == manifest["sha256"]:
        return f"{site}: already holds this bundle"
    packed = (bundle_dir / BUNDLE).read_bytes()
    got = hashlib.sha256(packed).hexdigest()
    if got != manifest["sha256"]:
        raise SystemExit(f"{bundle_dir / BUNDLE}: SHA-256 {got} is not the manifest's {manifest['sha256']} "
                         "(a partial transfer?)")
    if site.exists():
        import shutil

        shutil.rmtree(site)
    site.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(packed), mode="r:xz") as tar:
        tar.extractall(site, filter="data")
    (site / MARKER).write_text(manifest["sha256"] + "\n")
    return f"{site}: unpacked {manifest['unpacked_bytes'] / MIB:.0f} MiB of {len(manifest['wheels'])} wheels"


def env_line(site: Path) -> str:
    """The shell line that puts the unpacked bundle on PYTHONPATH (empty without one)."""
    if not (site / MARKER).is_file():
        return ""
    return f'export PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site}:{site / DSL_PACKAGES}"'


def _exclude(*patterns: str) -> None:
    """Keep the bundle's folders out of git (they travel only when named)."""
    try:
        path = Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, check=True,
                                   capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return
    path = path if path.is_absolute() else ROOT / path
    have = path.read_text().splitlines() if path.is_file() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(have + [p for p in patterns if p not in have]) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["fetch", "build", "install", "env"])
    ap.add_argument("--wheels", default=str(ROOT / ".whl-fa4"), help="the downloaded wheels")
    ap.add_argument("--out", default=str(ROOT / ".carry/fa4"), help="the bundle's folder")
    ap.add_argument("--site", default=str(ROOT / ".carry/fa4-site"), help="where install unpacks it")
    ap.add_argument("--limit-mib", type=float, default=62.0)
    args = ap.parse_args()
    wheels, out, site = Path(args.wheels), Path(args.out), Path(args.site)
    if args.action == "fetch":
        _exclude("/.whl-fa4/", "/.carry/fa4/", "/.carry/fa4-site/")
        plat = [x for p in PLATFORMS for x in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(wheels),
                        *(f"{d}=={v}" for d, v in WHEELS.items())], check=True)
        print("\n".join(w.name for w in find_wheels(wheels)))
    elif args.action == "build":
        _exclude("/.whl-fa4/", "/.carry/fa4/", "/.carry/fa4-site/")
        print(json.dumps(build(find_wheels(wheels), out, args.limit_mib)))
    elif args.action == "install":
        print(install(out, site), file=sys.stderr)
    else:
        print(env_line(site))


if __name__ == "__main__":
    main()
