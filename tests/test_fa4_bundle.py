"""scripts/fa4_bundle.py: the FlashAttention-4 bundle for a GPU machine without a package index — the pinned
wheels' files in one xz tar checked against a size limit, unpacked once on the other side behind its SHA-256,
importable from the PYTHONPATH it prints (with the cutlass package's dsl_packages folder its .pth would add).
Fake wheels stand in for the real ones (the real build: ~50 MiB, minutes of xz)."""

import lzma
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import fa4_bundle as fb  # noqa: E402

FAST = [{"id": lzma.FILTER_LZMA2, "preset": 1}]
PINS = {"flash-attn-4": "4.0.0b36", "nvidia-cutlass-dsl-libs-cu13": "4.8.1"}


def _wheel(folder: Path, name: str, files: dict[str, bytes]) -> Path:
    path = folder / name
    with zipfile.ZipFile(path, "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
    return path


def _wheels(tmp_path: Path, big: int = 1000) -> Path:
    w = tmp_path / "wheels"
    w.mkdir()
    _wheel(w, "flash_attn_4-4.0.0b36-py3-none-any.whl",
           {"flash_attn/cute/__init__.py": b"VALUE = 4\n", "flash_attn_4-4.0.0b36.dist-info/METADATA": b"x"})
    _wheel(w, "flash_attn_4-4.0.0b35-py3-none-any.whl", {"flash_attn/cute/__init__.py": b"VALUE = 3\n"})
    _wheel(w, "nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl",
           {"nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py": b"OK = True\n",
            "nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so": bytes(range(256)) * big,
            "nvidia_cutlass_dsl/cu13/lib/stubs/aarch64-unknown-linux-gnu/libcute_dsl_runtime.so": b"arm"})
    return w


def test_build_install_and_import_from_the_printed_path(tmp_path):
    wheels = fb.find_wheels(_wheels(tmp_path), PINS)
    assert [w.name.split("-")[1] for w in wheels] == ["4.0.0b36", "4.8.1"]  # the pinned version, not 0b35
    m = fb.build(wheels, tmp_path / "bundle", limit_mib=1, filters=FAST)
    assert m["bytes"] == (tmp_path / "bundle" / fb.BUNDLE).stat().st_size and m["mib"] < 1
    site = tmp_path / "site"
    assert "unpacked" in fb.install(tmp_path / "bundle", site)
    assert not (site / "nvidia_cutlass_dsl/cu13/lib/stubs").exists()  # the Arm stubs are not shipped
    assert (site / "flash_attn_4-4.0.0b36.dist-info/METADATA").is_file()
    assert "already holds this bundle" in fb.install(tmp_path / "bundle", site)  # the second call: nothing
    line = fb.env_line(site)
    code = "import flash_attn.cute as f, cutlass as c; print(f.VALUE, c.OK)"
    out = subprocess.run(["bash", "-c", f"{line}; {sys.executable} -c '{code}'"], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["4", "True"], out.stderr
    assert fb.env_line(tmp_path / "nothing") == ""


def test_a_bundle_over_the_limit_is_refused_and_not_written(tmp_path):
    wheels = fb.find_wheels(_wheels(tmp_path, big=1), PINS)
    incompressible = os.urandom(300_000)
    _wheel(tmp_path / "wheels", "x.whl", {"blob.bin": incompressible})
    with pytest.raises(SystemExit, match=r"bundle is 0\.\d\d MiB, over the 0\.2 MiB limit: not written"):
        fb.build(wheels + [tmp_path / "wheels" / "x.whl"], tmp_path / "bundle", limit_mib=0.2, filters=FAST)
    assert not (tmp_path / "bundle").exists()


def test_a_missing_wheel_a_clash_and_a_damaged_bundle_are_each_one_error(tmp_path):
    w = _wheels(tmp_path)
    with pytest.raises(SystemExit, match=r"no wheel for quack-kernels==0\.6\.5 .*fa4_bundle.py fetch"):
        fb.find_wheels(w, {**PINS, "quack-kernels": "0.6.5"})
    clash = _wheel(tmp_path, "clash-1-py3-none-any.whl", {"flash_attn/cute/__init__.py": b""})
    with pytest.raises(SystemExit, match="flash_attn/cute/__init__.py is in another wheel"):
        fb.build(fb.find_wheels(w, PINS) + [clash], tmp_path / "b", limit_mib=1, filters=FAST)
    fb.build(fb.find_wheels(w, PINS), tmp_path / "b", limit_mib=1, filters=FAST)
    with open(tmp_path / "b" / fb.BUNDLE, "r+b") as f:  # a transfer cut short
        f.truncate(100)
    with pytest.raises(SystemExit, match="SHA-256 .* is not the manifest's"):
        fb.install(tmp_path / "b", tmp_path / "site")
    assert not (tmp_path / "site").exists()
