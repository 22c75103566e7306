#!/usr/bin/env python3
"""Build the testbed's SIGNED apt repositories of NVIDIA stand-in packages.

These machines cannot reach NVIDIA's repositories (docs/testbed.md),
so the roles are tested against stand-in .debs that carry NVIDIA's real package names and the
versions the roles pin, but contain only small scripts (./bin/) that say they are stand-ins.

Layout written under OUT (URL paths shaped like NVIDIA's, served by tests/testbed/apt-repo.sh):
  compute/cuda/repos/debian12/x86_64/   flat repo ("Suites: /"), driver packages
  compute/cuda/repos/debian13/x86_64/   same packages
  compute/cuda/repos/<distro>/x86_64/testbed.pub   the armoured TEST key
  libnvidia-container/stable/deb/amd64/ flat repo, container toolkit packages
  libnvidia-container/gpgkey            the armoured TEST key (NVIDIA publishes theirs there too)

Package names and the split follow NVIDIA's CUDA repository for Debian 12/13 (driver branch 580,
open kernel modules: nvidia-open -> nvidia-driver + nvidia-kernel-open-dkms; nvidia-smi,
nvidia-persistenced, libnvidia-ml1, libcuda1; index at
https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/) and the container
toolkit release notes (1.18.2 ships nvidia-container-toolkit, nvidia-container-toolkit-base,
libnvidia-container-tools, libnvidia-container1;
https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/release-notes.html).

Usage: build_repo.py OUT GNUPGHOME KEY_FINGERPRINT
Needs dpkg-deb and gpg on PATH. Raises SystemExit on a failed tool.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = HERE / "bin"

# Two driver versions of branch 580, so the upgrade path (change the pin) can be tested.
# 580.95.05 and 580.105.08 are NVIDIA production-branch releases of R580 (driver release notes,
# https://docs.nvidia.com/datacenter/tesla/); "-1" is the Debian revision NVIDIA's Debian repo uses.
DRIVER_VERSIONS = ["580.95.05-1", "580.105.08-1"]
# NVIDIA Container Toolkit 1.18.0 (the release that added nvidia-cdi-refresh, toolkit docs "Support for
# Container Device Interface") and 1.18.2 (release notes above), so the toolkit's upgrade path can be
# tested too; "-1" as in NVIDIA's deb repo.
TOOLKIT_VERSIONS = ["1.18.0-1", "1.18.2-1"]
DISTROS = ["debian12", "debian13"]
MAINTAINER = "teamserve testbed <testbed@teamserve.invalid>"
LIBDIR = "usr/lib/x86_64-linux-gnu"


def stand_in(name: str, what: str) -> str:
    """Return a Description field that states plainly that the package is a stand-in."""
    return (f"TEST STAND-IN for NVIDIA's {name} (teamserve testbed)\n"
            f" Not NVIDIA software. {what}\n"
            " Built by tests/testbed/nvidia/build_repo.py; never install it on a real host.")


def upstream(version: str) -> str:
    """'580.95.05-1' -> '580.95.05' (the upstream part of a Debian version)."""
    return version.rsplit("-", 1)[0]


def driver_packages(v: str) -> list[dict]:
    """The stand-in driver packages of one version: control fields plus files {path: content}."""
    u = upstream(v)
    sub = {"@DRIVER_VERSION@": u}
    return [
        {"Package": "nvidia-open", "Depends": f"nvidia-driver (= {v}), nvidia-kernel-open-dkms (= {v})",
         "Description": stand_in("nvidia-open", "Meta-package: driver with the open GPU kernel modules."),
         "files": {}},
        {"Package": "nvidia-driver",
         "Depends": f"nvidia-smi (= {v}), nvidia-persistenced (= {v}), libnvidia-ml1 (= {v}), libcuda1 (= {v})",
         "Description": stand_in("nvidia-driver", "Meta-package for the user-space driver."), "files": {}},
        {"Package": "nvidia-kernel-open-dkms", "Depends": "dkms",
         "Description": stand_in("nvidia-kernel-open-dkms", "Ships no kernel module source; builds nothing."),
         "files": {"usr/share/doc/nvidia-kernel-open-dkms/TEST-STAND-IN": f"open kernel modules {u}\n"}},
        {"Package": "nvidia-smi", "Depends": f"libnvidia-ml1 (= {v})",
         "Description": stand_in("nvidia-smi", "Prints a 96 GB RTX PRO 6000 Blackwell; see the script."),
         "files": {"usr/bin/nvidia-smi": ("nvidia-smi", sub, 0o755)}},
        {"Package": "nvidia-persistenced",
         "Description": stand_in("nvidia-persistenced", "A foreground loop with the real unit name."),
         "scripts": {"postinst": ("postinst-daemon-reload", {"@PACKAGE@": "nvidia-persistenced"}, 0o755)},
         "files": {"usr/bin/nvidia-persistenced": ("nvidia-persistenced", sub, 0o755),
                   "lib/systemd/system/nvidia-persistenced.service": ("nvidia-persistenced.service", {}, 0o644)}},
        {"Package": "libnvidia-ml1",
         "Description": stand_in("libnvidia-ml1", "The library file is a text marker."),
         "files": {f"{LIBDIR}/libnvidia-ml.so.{u}": f"TEST STAND-IN libnvidia-ml {u}\n"}},
        {"Package": "libcuda1",
         "Description": stand_in("libcuda1", "The library file is a text marker."),
         "files": {f"{LIBDIR}/libcuda.so.{u}": f"TEST STAND-IN libcuda {u}\n"}},
    ]


def toolkit_packages(v: str) -> list[dict]:
    """The stand-in container toolkit packages of one version."""
    u = upstream(v)
    sub = {"@TOOLKIT_VERSION@": u}
    return [
        {"Package": "libnvidia-container1",
         "Description": stand_in("libnvidia-container1", "The library file is a text marker."),
         "files": {f"{LIBDIR}/libnvidia-container.so.{u}": f"TEST STAND-IN libnvidia-container {u}\n"}},
        {"Package": "libnvidia-container-tools", "Depends": f"libnvidia-container1 (>= {v})",
         "Description": stand_in("libnvidia-container-tools", "nvidia-container-cli --version / info only."),
         "files": {"usr/bin/nvidia-container-cli": ("nvidia-container-cli", sub, 0o755)}},
        {"Package": "nvidia-container-toolkit-base", "Depends": "python3",
         "Description": stand_in("nvidia-container-toolkit-base",
                                 "nvidia-ctk runtime configure --runtime=docker; the runtime execs runc."),
         "scripts": {"postinst": ("postinst-daemon-reload", {"@PACKAGE@": "nvidia-container-toolkit-base"}, 0o755)},
         "files": {"usr/bin/nvidia-ctk": ("nvidia-ctk", sub, 0o755),
                   "usr/bin/nvidia-container-runtime": ("nvidia-container-runtime", sub, 0o755)}},
        # The hook bind-mounts the stand-in driver (nvidia-smi, library markers, a device-access file)
        # into --gpus containers from their mount namespace (python3, nsenter, mount); the generator
        # revokes that access on `systemctl daemon-reload` (NVIDIA/nvidia-container-toolkit#48).
        {"Package": "nvidia-container-toolkit",
         "Depends": f"nvidia-container-toolkit-base (= {v}), libnvidia-container-tools (>= {v}), "
                    "python3, util-linux, mount",
         "Description": stand_in("nvidia-container-toolkit",
                                 "The OCI hook bind-mounts the stand-in nvidia-smi into --gpus containers; a\n"
                                 " systemd generator reproduces GPU loss on daemon-reload (toolkit issue 48)."),
         "files": {"usr/bin/nvidia-container-runtime-hook": ("nvidia-container-runtime-hook", sub, 0o755),
                   "usr/lib/systemd/system-generators/teamserve-testbed-gpu-access-reset":
                       ("teamserve-testbed-gpu-access-reset", sub, 0o755)}},
    ]


def run(*argv: str, **kw) -> subprocess.CompletedProcess:
    """Run a tool; SystemExit with its stderr when it fails."""
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def build_deb(pkg: dict, version: str, out_dir: Path) -> Path:
    """Build one .deb with dpkg-deb into out_dir; return its path.

    pkg["files"] maps paths in the package to literal content or (script in bin/, substitutions, mode);
    pkg["scripts"] (optional) maps maintainer scripts (postinst, ...) to the same tuples.
    """
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "DEBIAN").mkdir()
        entries = list(pkg["files"].items())
        entries += [(f"DEBIAN/{name}", spec) for name, spec in pkg.get("scripts", {}).items()]
        for rel, spec in entries:
            dest = root / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(spec, tuple):
                src, subs, mode = spec
                text = (BIN / src).read_text(encoding="utf-8")
                for key, val in subs.items():
                    text = text.replace(key, val)
                dest.write_text(text, encoding="utf-8")
                dest.chmod(mode)
            else:
                dest.write_text(spec, encoding="utf-8")
                dest.chmod(0o644)
        fields = {"Package": pkg["Package"], "Version": version, "Architecture": "amd64",
                  "Maintainer": MAINTAINER, "Section": "non-free/libs", "Priority": "optional",
                  "Homepage": "https://github.com/teamserve (testbed stand-in)"}
        if pkg.get("Depends"):
            fields["Depends"] = pkg["Depends"]
        fields["Description"] = pkg["Description"]
        control = "".join(f"{k}: {v}\n" for k, v in fields.items())
        (root / "DEBIAN" / "control").write_text(control, encoding="utf-8")
        deb = out_dir / f"{pkg['Package']}_{version}_amd64.deb"
        run("dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(root), str(deb))
    return deb


def packages_index(repo: Path) -> str:
    """The Packages index of a flat repo: control fields of each .deb plus file name, size, hashes."""
    entries = []
    for deb in sorted(repo.glob("*.deb")):
        control = run("dpkg-deb", "-f", str(deb)).stdout.rstrip("\n")
        data = deb.read_bytes()
        entries.append(control + "\n"
                       f"Filename: ./{deb.name}\nSize: {len(data)}\n"
                       f"MD5sum: {hashlib.md5(data).hexdigest()}\n"
                       f"SHA256: {hashlib.sha256(data).hexdigest()}\n")
    return "\n".join(entries)


def write_index(repo: Path, label: str, gnupghome: str, fingerprint: str) -> None:
    """Write Packages, Packages.gz, Release, InRelease and Release.gpg for a flat repo."""
    text = packages_index(repo).encode()
    (repo / "Packages").write_bytes(text)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        gz.write(text)
    (repo / "Packages.gz").write_bytes(buf.getvalue())
    lines = ["Origin: NVIDIA", f"Label: {label} (TEST STAND-IN, teamserve testbed)", "Architectures: amd64",
             "Date: " + time.strftime("%a, %d %b %Y %H:%M:%S UTC", time.gmtime())]
    for algo, name in (("md5", "MD5Sum"), ("sha256", "SHA256")):
        lines.append(f"{name}:")
        for f in ("Packages", "Packages.gz"):
            data = (repo / f).read_bytes()
            lines.append(f" {hashlib.new(algo, data).hexdigest()} {len(data)} {f}")
    (repo / "Release").write_text("\n".join(lines) + "\n", encoding="utf-8")
    env = {"GNUPGHOME": gnupghome, "PATH": "/usr/bin:/bin"}
    for f in ("InRelease", "Release.gpg"):
        (repo / f).unlink(missing_ok=True)
    run("gpg", "--batch", "--yes", "--local-user", fingerprint, "--clearsign",
        "-o", str(repo / "InRelease"), str(repo / "Release"), env=env)
    run("gpg", "--batch", "--yes", "--local-user", fingerprint, "--armor", "--detach-sign",
        "-o", str(repo / "Release.gpg"), str(repo / "Release"), env=env)


def main(out: str, gnupghome: str, fingerprint: str) -> None:
    """Build everything into OUT (replaced as a whole)."""
    out_path = Path(out)
    staging = Path(tempfile.mkdtemp(prefix="apt.", dir=out_path.parent))
    key = run("gpg", "--batch", "--armor", "--export", fingerprint,
              env={"GNUPGHOME": gnupghome, "PATH": "/usr/bin:/bin"}).stdout
    cuda_first = None
    for distro in DISTROS:
        repo = staging / "compute/cuda/repos" / distro / "x86_64"
        repo.mkdir(parents=True)
        if cuda_first is None:
            for v in DRIVER_VERSIONS:
                for pkg in driver_packages(v):
                    build_deb(pkg, v, repo)
            cuda_first = repo
        else:
            for deb in cuda_first.glob("*.deb"):
                shutil.copy2(deb, repo / deb.name)
        write_index(repo, "NVIDIA CUDA", gnupghome, fingerprint)
        (repo / "testbed.pub").write_text(key, encoding="utf-8")
    repo = staging / "libnvidia-container/stable/deb/amd64"
    repo.mkdir(parents=True)
    for v in TOOLKIT_VERSIONS:
        for pkg in toolkit_packages(v):
            build_deb(pkg, v, repo)
    write_index(repo, "libnvidia-container", gnupghome, fingerprint)
    (staging / "libnvidia-container/gpgkey").write_text(key, encoding="utf-8")
    (staging / "index.html").write_text("teamserve testbed: stand-in NVIDIA apt repositories (TEST ONLY)\n")
    if out_path.exists():
        shutil.rmtree(out_path)
    staging.rename(out_path)
    out_path.chmod(0o755)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
