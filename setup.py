"""Build hook only; the project's metadata is in pyproject.toml.

build_py first generates the kubelet plugins' gRPC modules from nvctk/k8s/api.proto
(the device plugin), nvctk/dra/third_party/*.proto (the DRA plugin) and
nvctk/engines/third_party/cri_api.proto (the CRI: configure's restart waits on it)
(grpcio-tools, a build requirement).

A wheel (and the Debian package, built from one) carries libvgpu.so as
nvctk/lib/libvgpu.so: build_py runs `make -C libvgpu` and copies the library in.
Editable installs skip this: nvctk.host.paths finds libvgpu/build/libvgpu.so in the tree.
NVCTK_SKIP_LIBVGPU=1 builds a wheel without the library (nvctk then refuses
containers that ask for GPU limits, saying why).

The executables nvctk, nvctk-hook and nvctk-runtime are one C launcher
(runtime_shim/launcher.c) compiled per program from cli/nvctk.c, hooks/nvctk-hook.c
and runtime_shim/nvctk-runtime.c; build_scripts compiles them and the wheel carries
them as its scripts, the same files in every layout (see launcher.c).

nvctk._sys (nvctk/_sys.c, nvctk/_sys_codec.c) is an ordinary extension module: the syscalls the hook and
the runtime need that `os` lacks, on Python's public C API (no ctypes on the
container-start path). Every build has it; an editable install (`make venv`) builds
it in place, next to its source.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from distutils.command.build_scripts import build_scripts

HERE = os.path.dirname(os.path.abspath(__file__))
LIBVGPU_DIR = os.path.join(HERE, "libvgpu")
LIBVGPU_TARGET = "build/libvgpu.so"


class BuildPyWithLibvgpu(build_py):
    """build_py, then build libvgpu and put it at <build_lib>/nvctk/lib/libvgpu.so."""

    def run(self) -> None:
        # the kubelet plugins' gRPC modules, generated beside their .proto (not committed)
        gen = os.path.join(HERE, "nvctk", "k8s", "gen.py")
        try:
            subprocess.run([sys.executable, gen], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(f"nvctk: generating the kubelet plugins' gRPC code failed ({e})")
        super().run()
        if getattr(self, "editable_mode", False):
            return
        # libvgpu's CUDA header, which the simulated driver (nvctk/sim/build.py) compiles
        # against too: in every wheel, with or without the library
        include = os.path.join(self.build_lib, "nvctk", "lib", "include")
        os.makedirs(include, exist_ok=True)
        shutil.copy2(os.path.join(LIBVGPU_DIR, "include", "cuda_abi.h"), include)
        if os.environ.get("NVCTK_SKIP_LIBVGPU") == "1":
            self.announce("nvctk: NVCTK_SKIP_LIBVGPU=1: the wheel has no libvgpu.so", level=3)
            return
        make = os.environ.get("MAKE", "make")
        try:
            subprocess.run([make, "-s", "-C", LIBVGPU_DIR, LIBVGPU_TARGET], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(
                f"nvctk: building libvgpu failed ({e}); fix it, or set NVCTK_SKIP_LIBVGPU=1 "
                "for a wheel without GPU sharing"
            )
        dest = os.path.join(self.build_lib, "nvctk", "lib")
        os.makedirs(dest, exist_ok=True)
        shutil.copy2(os.path.join(LIBVGPU_DIR, LIBVGPU_TARGET), os.path.join(dest, "libvgpu.so"))


# program name -> its source; all three include runtime_shim/launcher.c
LAUNCHERS = {
    "nvctk": "cli/nvctk.c",
    "nvctk-hook": "hooks/nvctk-hook.c",
    "nvctk-runtime": "runtime_shim/nvctk-runtime.c",
}


class BuildLaunchers(build_scripts):
    """Compiles the launchers into the scripts build dir (copied from there as they are:
    an ELF has no #! line to rewrite)."""

    def run(self) -> None:
        cc = os.environ.get("CC", "cc")
        os.makedirs(self.build_dir, exist_ok=True)
        for name, source in LAUNCHERS.items():
            out = os.path.join(self.build_dir, name)
            cmd = [cc, "-O2", "-Wall", "-Wextra", "-Werror", "-o", out, os.path.join(HERE, source)]
            try:
                # static-pie: no dynamic loader, no libc to map and relocate at each
                # start (nvctk-runtime's passthrough, runc's start of nvctk-hook: 0.17 ms
                # of ~0.6 ms over runc), and still position-independent (ASLR)
                subprocess.run([*cmd, "-static-pie"], check=True)
            except (OSError, subprocess.CalledProcessError) as e:
                if os.environ.get("NVCTK_DYNAMIC_LAUNCHERS") != "1":
                    raise SystemExit(
                        f"nvctk: compiling the launcher {name} with -static-pie failed ({e}); "
                        "install the static C library (Debian: libc6-dev), or set "
                        "NVCTK_DYNAMIC_LAUNCHERS=1 for dynamically linked launchers"
                    )
                try:
                    subprocess.run(cmd, check=True)
                except (OSError, subprocess.CalledProcessError) as e2:
                    raise SystemExit(f"nvctk: compiling the launcher {name} failed ({e2})")


SYS_EXTENSION = Extension(
    "nvctk._sys",
    sources=["nvctk/_sys.c", "nvctk/_sys_codec.c"],  # syscalls and module; the codec
    depends=["nvctk/_sys.h"],
    extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration"],
    libraries=["b2", "jansson"],  # libb2 (BLAKE2b) and jansson (JSON decoding)
)

setup(
    cmdclass={"build_py": BuildPyWithLibvgpu, "build_scripts": BuildLaunchers},
    ext_modules=[SYS_EXTENSION],
    scripts=list(LAUNCHERS.values()),  # what build_scripts compiles, not copies
)
