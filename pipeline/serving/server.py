"""Start a real Triton Inference Server and always stop it: the one place that knows how.

On a CPU machine the server is the Triton 2.51 binary inside the ``nvidia-pytriton`` package (Python backend
and ensembles only). Running it by hand has traps, each handled here:

- the Python-backend stub ships per Python version beside the backend, not in it: we build a backends
  folder of our own (in a temporary folder, never inside site-packages) with the backend library linked and
  the stub for the serving Python's version copied in;
- that stub and the backend find their bundled libraries through an ``$ORIGIN`` rpath that no longer points
  anywhere once copied, so the package's library folder goes on ``LD_LIBRARY_PATH``;
- the stub runs the ``python3`` first on ``PATH`` and links the ``libpython`` it finds: the serving
  environment's ``bin`` goes first on ``PATH`` and its Python's ``LIBDIR`` first on ``LD_LIBRARY_PATH``
  (otherwise a pyenv-built Python fails inside model.py with ``undefined symbol: _PyModule_Add``);
- with numpy 2 in that environment every output tensor silently comes back empty: refused up front;
- the Python backend's shared-memory regions get a prefix unique to this server, and whatever a killed
  server leaves in /dev/shm under it is removed when it stops.

Every server binds 127.0.0.1 only (unless told otherwise), on free ports, runs in its own process group,
and is stopped by ``stop()`` / leaving the ``with`` block: SIGTERM to the process and its group, SIGKILL
after a grace period. If the process that started it dies first, the server gets SIGKILL (Linux) and its
group's reaper ends its stubs and removes its shared memory and temporary folder (pipeline.reaper).

On a GPU machine (inside the Triton TensorRT-LLM image) pass ``binary=`` the image's ``tritonserver`` and
``backend_dir=None``: it has its own backends, stub and Python.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional, Sequence

from pipeline.errors import EnvironmentProblem, InputError, StageFailed
from pipeline.procs import SHM_DIR, start_group, stop_process_group
from pipeline.serving import launch
from pipeline.serving.ports import LOOPBACK, START_TRIES, fill_ports, lost_port_race
from pipeline.tenancy import TENANT_HEADER_ARGS

log = logging.getLogger(__name__)

STUB_NAME = "triton_python_backend_stub"
READY_TIMEOUT_S = 300.0  # the CPU repository: ~7 s alone on 2 cores; over 120 s seen in CI, beside a second test
# worker and a vLLM engine on those 2 cores
METRICS_BIND_S = 30.0  # the least wait for the metrics port once /v2/health/ready has answered
VLLM_READY_TIMEOUT_S = 600.0  # vLLM's import and engine start: 40-90 s on 2 busy cores
LOG_TAIL_LINES = 40
STACKS_SIGNAL = "SIGUSR1"  # the signal the Triton models dump their threads' stacks on (llm_io.STACKS_SIGNAL)
_NOISE = "CudaDriverHelper has not been initialized"  # logged by every start on a machine without a GPU


@dataclass(frozen=True)
class PytritonDist:
    """Where the server pieces are inside the installed nvidia-pytriton package."""

    root: Path  # .../site-packages/pytriton/tritonserver
    libs: Path  # .../site-packages/nvidia_pytriton.libs (bundled shared libraries)

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    @property
    def caches(self) -> Path:
        return self.root / "caches"

    def stub(self, py_version: str) -> Path:
        return self.root / "python_backend_stubs" / py_version / STUB_NAME


def find_pytriton() -> PytritonDist:
    """Locate the server inside the nvidia-pytriton package without importing it (its import is heavy)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise EnvironmentProblem(
            "Triton Inference Server is not installed: the CPU server comes from the `nvidia-pytriton` package "
            "(pip install -e '.[dev]' installs it). On a GPU machine run inside the Triton TensorRT-LLM image."
        )
    pkg = Path(list(spec.submodule_search_locations)[0])
    dist = PytritonDist(pkg / "tritonserver", pkg.parent / "nvidia_pytriton.libs")
    if not dist.binary.is_file():
        raise EnvironmentProblem(f"the nvidia-pytriton package at {pkg} has no server binary ({dist.binary}); "
                                 f"reinstall it")
    return dist


@dataclass(frozen=True)
class PythonEnv:
    """The Python environment the Python-backend stub runs model.py in."""

    bin_dir: Path  # first on the server's PATH: its python3 is the stub's interpreter
    version: str  # "3.11"
    libdir: Path  # where its libpython lives
    numpy_version: str


def probe_python_env(bin_dir: Optional[Path] = None) -> PythonEnv:
    """Ask the environment's python3 for its version, libpython folder and numpy; refuse numpy >= 2."""
    bin_dir = Path(bin_dir) if bin_dir else Path(sys.executable).parent  # not resolved: a venv's bin
    exe = bin_dir / "python3"
    if not exe.exists():
        exe = bin_dir / "python"
    code = ("import json, sys, sysconfig\n"
            "try:\n import numpy; nv = numpy.__version__\nexcept ImportError:\n nv = None\n"
            "print(json.dumps({'version': '%d.%d' % sys.version_info[:2], "
            "'libdir': sysconfig.get_config_var('LIBDIR'), 'numpy': nv}))")
    try:
        out = subprocess.run([str(exe), "-c", code], capture_output=True, text=True, timeout=60, check=True)
        facts = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise EnvironmentProblem(f"cannot run the serving Python {exe}: {e}") from None
    if facts["numpy"] is None:
        raise EnvironmentProblem(f"the serving Python {exe} has no numpy; the Triton Python backend needs numpy<2")
    if int(facts["numpy"].split(".")[0]) >= 2:
        raise EnvironmentProblem(
            f"the serving Python {exe} has numpy {facts['numpy']}: with numpy 2 the Triton Python-backend stub "
            f"returns every output tensor empty. Give the Triton models an environment with numpy<2."
        )
    return PythonEnv(bin_dir, facts["version"], Path(facts["libdir"] or "/usr/lib"), facts["numpy"])


def prepare_backends_dir(dest: Path, dist: PytritonDist, env: PythonEnv) -> Path:
    """A backends folder for the pytriton server: python/ holds the backend (linked) and the stub (copied)."""
    stub = dist.stub(env.version)
    if not stub.is_file():
        have = sorted(p.name for p in (dist.root / "python_backend_stubs").iterdir())
        raise EnvironmentProblem(f"nvidia-pytriton has no Python-backend stub for Python {env.version} "
                                 f"(it has: {', '.join(have)}); serve from a Python of one of those versions")
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    for item in dist.python_backend.iterdir():
        if item.is_file() and item.suffix in (".so", ".py"):
            target = py / item.name
            if not target.exists():
                target.symlink_to(item)
    shutil.copy2(stub, py / STUB_NAME)
    os.chmod(py / STUB_NAME, 0o755)
    return dest




TMP_PREFIX = "tritonserver-"  # + the starting process's pid: <tmp>/tritonserver-<pid>-<random>/
SHM_PREFIX = "tps"  # + the starting process's pid: /dev/shm/tps<pid>_<random>_...


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``sig`` (SigCgt in /proc/<pid>/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(caught >> (sig - 1) & 1)


def remove_stale_leftovers(*, quiet: bool = False) -> list[Path]:
    """Remove the shared-memory regions and temporary folders of servers whose starting process is dead (a run
    of this pipeline killed before it could stop its server); returns what was removed, and logs it unless
    ``quiet`` (the caller says it itself)."""
    removed = []
    candidates = [(p, p.name[len(SHM_PREFIX):].split("_", 1)[0]) for p in SHM_DIR.glob(f"{SHM_PREFIX}*_*")] \
        if SHM_DIR.is_dir() else []
    candidates += [(p, p.name[len(TMP_PREFIX):].split("-", 1)[0])
                   for p in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*-*")]
    for path, pid in candidates:
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(path)
        except OSError:
            pass
    if removed and not quiet:
        log.info("removed %d leftover(s) of dead servers: %s", len(removed), ", ".join(p.name for p in removed))
    return removed


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The server log's error lines, then its last lines, without the ASCII tables it prints."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    text = [l for l in text if l.strip() and not l.startswith(("+", "|")) and _NOISE not in l]
    errors = [l for l in text if l[:1] == "E" and l[1:5].isdigit()]
    tail = [l for l in text[-lines:] if l not in errors]
    return "\n".join(errors[-lines:] + (["..."] if errors and tail else []) + tail)


class ServerProcess:
    """What every server the pipeline starts shares: its process (in a session of its own), a context manager
    that starts and stops it, and whether it is still alive."""

    process: Optional[subprocess.Popen]

    def start(self):
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process else None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_code_within(self, timeout_s: float) -> Optional[int]:
        """The server's exit code if it has ended or ends within ``timeout_s``, else None. After a failed
        request, a server killed a moment ago may not be reaped yet: its sockets close before it exits."""
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def wait_ready(self, url: str, timeout_s: float, poll_s: float = 0.1) -> bool:
        """Whether ``url`` answers 200 within ``timeout_s``; False as soon as the process has ended."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(poll_s)
        return False


@dataclass
class TritonServer(ServerProcess):
    """A tritonserver process on a model repository. Use as a context manager; ``start()`` waits for ready.

    ``load_models``: start in explicit model-control mode with these models loaded (``["*"]``: all); None:
    the default mode, where a model that fails to load stops the server.
    """

    model_repository: Path
    http_port: int = 0  # 0: a free port
    grpc_port: int = 0
    metrics_port: int = 0
    host: str = LOOPBACK
    load_models: Optional[Sequence[str]] = None
    log_path: Optional[Path] = None  # default: a temporary file, removed on stop (its tail is in any error)
    python_bin_dir: Optional[Path] = None  # the stub's environment; default: this interpreter's bin/
    environment: Optional[dict] = None  # the server's environment variables; default: this process's
    binary: Optional[Path] = None  # default: the nvidia-pytriton binary
    backend_dir: Optional[Path] = None  # default: prepared for the pytriton binary; with binary=: its own
    log_verbose: int = 0
    extra_args: Sequence[str] = ()
    world_size: int = 1  # GPU ranks: > 1 starts one tritonserver per rank under mpirun (launch.py, leader mode)
    tensorrt_llm_model: str = ""  # the engine model the ranks > 0 load
    ready_timeout_s: float = READY_TIMEOUT_S

    process: Optional[subprocess.Popen] = field(default=None, init=False, repr=False)
    shm_prefix: str = field(default="", init=False)
    startup_s: Optional[float] = field(default=None, init=False)
    _tmp: Optional[Path] = field(default=None, init=False, repr=False)
    _backends: Optional[Path] = field(default=None, init=False, repr=False)
    _log_file: Optional[IO[bytes]] = field(default=None, init=False, repr=False)

    # ------------------------------------------------------------ endpoints

    @property
    def http_url(self) -> str:  # host:port, as tritonclient wants it
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    # ------------------------------------------------------------ lifecycle

    def command(self) -> list[str]:
        """The tritonserver command line (ports must be chosen already)."""
        binary = self.binary or find_pytriton().binary
        cmd = [str(binary), f"--model-repository={self.model_repository}",
               f"--http-address={self.host}", f"--http-port={self.http_port}",
               f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
               f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
               "--disable-auto-complete-config", "--exit-timeout-secs=10", f"--log-verbose={self.log_verbose}",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}", *TENANT_HEADER_ARGS]
        if self.binary is None:  # the CPU server: no GPU to report on, no pinned host memory to pool
            cmd += ["--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0"]
        if self._backends is not None:
            cmd.append(f"--backend-directory={self._backends}")
        if self.binary is None:
            cmd.append(f"--cache-directory={find_pytriton().caches}")
        if self.load_models is not None:
            cmd.append("--model-control-mode=explicit")
            cmd += [f"--load-model={m}" for m in self.load_models]
        cmd += list(self.extra_args)
        if self.world_size > 1:
            mpirun = shutil.which(launch.MPIRUN)
            if mpirun is None:
                raise EnvironmentProblem(f"the repository needs {self.world_size} GPU ranks, started by mpirun, "
                                         f"which is not on PATH: run it inside the Triton TensorRT-LLM image")
            return launch.server_argv(cmd[0], cmd[1:], self.world_size, self.tensorrt_llm_model, mpirun=mpirun)
        return cmd

    def start(self) -> "TritonServer":
        if self.process is not None:
            raise RuntimeError("server already started")
        repo = Path(self.model_repository)
        if not repo.is_dir():
            raise InputError(f"model repository {repo} does not exist; run `invoke publish` first")
        self.model_repository = repo.resolve()
        remove_stale_leftovers()
        self._tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
        self.shm_prefix = f"{SHM_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        env = dict(os.environ if self.environment is None else self.environment)
        self._backends = self.backend_dir
        if self.binary is None:
            dist = find_pytriton()
            pyenv = probe_python_env(self.python_bin_dir)
            if self._backends is None:
                self._backends = prepare_backends_dir(self._tmp / "backends", dist, pyenv)
            env["PATH"] = os.pathsep.join([str(pyenv.bin_dir), env.get("PATH", "")])
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (str(pyenv.libdir), str(dist.libs), env.get("LD_LIBRARY_PATH", "")) if p)
        if self.log_path is None:
            self.log_path = self._tmp / "tritonserver.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        want = {"http_port": self.http_port, "grpc_port": self.grpc_port, "metrics_port": self.metrics_port}
        t0 = time.monotonic()
        try:
            for attempt in range(START_TRIES):  # a free port can be taken between choosing it and binding it
                self.http_port, self.grpc_port, self.metrics_port = fill_ports(want, self.host)
                self._spawn(env, self.log_path)
                if self._wait_ready():
                    break
                if attempt < START_TRIES - 1 and not all(want.values()) and lost_port_race(log_tail(self.log_path)):
                    log.info("a chosen port was taken meanwhile; retrying with new ports")
                    self._terminate()
                    continue
                if self.process is not None and self.process.poll() is None:
                    self.dump_python_stacks()  # still loading: where each model stood goes into the log's tail
                raise StageFailed(self._failure_message(self.log_path))
        except BaseException:
            self.stop()
            raise
        self.startup_s = round(time.monotonic() - t0, 2)
        log.info("tritonserver ready in %.1f s (pid %d): http %s, grpc %s", self.startup_s, self.pid,
                 self.http_url, self.grpc_url)
        return self

    def _spawn(self, env: dict, log_path: Path) -> None:
        if self._log_file is not None:
            self._log_file.close()
        self._log_file = open(log_path, "ab")
        cmd = self.command()
        log.info("starting %s", " ".join(cmd))
        self.process = start_group(cmd, "tritonserver", tmp=[self._tmp] if self._tmp else [],
                                   shm_prefix=[self.shm_prefix] if self.shm_prefix else [],
                                   stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, cwd=str(self._tmp))

    def _wait_ready(self) -> bool:
        """Ready, with every endpoint bound. tritonserver loads its models, then starts gRPC, HTTP and last the
        metrics service (src/main.cc, StartEndpoints): /v2/health/ready answers before the metrics port is bound,
        and a metrics port taken meanwhile ends the server after it was ready."""
        deadline = time.monotonic() + self.ready_timeout_s
        if not self.wait_ready(f"http://{self.host}:{self.http_port}/v2/health/ready", self.ready_timeout_s):
            return False
        if "--allow-metrics=false" in self.extra_args:
            return True
        return self.wait_ready(self.metrics_url, max(deadline - time.monotonic(), METRICS_BIND_S))

    def _failure_message(self, log_path: Path) -> str:
        code = self.process.poll() if self.process else None
        state = (f"exited with code {code}" if code is not None
                 else f"was not ready after {self.ready_timeout_s:.0f} s")
        where = "" if self._tmp is not None and self._tmp in log_path.parents else f" {log_path}"
        return f"tritonserver {state}. From its log{where} (errors first):\n{log_tail(log_path)}"

    def dump_python_stacks(self, settle_s: float = 0.3) -> int:
        """Ask each Python-backend stub of this server that catches STACKS_SIGNAL (the models' faulthandler,
        ``llm_io.stacks_on_signal``) for every thread's stack, one stub at a time, each dump after a line naming
        its model in the server's log (``settle_s`` for each to be written). Returns how many stubs were asked.
        A stub that does not catch the signal (a repository published before its models did) is left alone: the
        signal would end it."""
        import psutil  # read at failure time only

        if not self.is_alive() or self._log_file is None:
            return 0
        sig = getattr(signal, STACKS_SIGNAL)
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return 0
        asked = 0
        for child in children:
            try:
                cmd = child.cmdline()
                if len(cmd) < 2 or Path(cmd[0]).name != STUB_NAME or not catches(child.pid, sig):
                    continue
                model = Path(cmd[1]).parent.parent.name  # <repository>/<model>/<version>/model.py
                self._log_file.write(f"--- the Python threads of model {model} (stub pid {child.pid}):\n".encode())
                self._log_file.flush()
                child.send_signal(sig)
                asked += 1
                time.sleep(settle_s)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return asked

    def _terminate(self) -> None:
        """SIGTERM to the server and its process group (Python-backend stubs), SIGKILL after a grace period."""
        stop_process_group(self.process, "tritonserver")
        self.process = None

    def stop(self) -> None:
        """Stop the server (if running), remove its shared-memory regions and its temporary folder."""
        self._terminate()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.shm_prefix and SHM_DIR.is_dir():
            for leftover in SHM_DIR.glob(self.shm_prefix + "*"):
                try:
                    leftover.unlink()
                except OSError:
                    pass
        if self._tmp is not None:  # the backends folder, and the log unless log_path named another place
            if self.log_path is not None and self._tmp in self.log_path.parents:
                self.log_path = None
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # ------------------------------------------------------------ model control

    def load_model(self, name: str) -> None:
        self._post(f"/v2/repository/models/{name}/load")

    def unload_model(self, name: str) -> None:
        self._post(f"/v2/repository/models/{name}/unload")

    def model_ready(self, name: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/models/{name}/ready", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _post(self, path: str) -> None:
        req = urllib.request.Request(f"http://{self.http_url}{path}", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300):
                pass
        except urllib.error.HTTPError as e:
            raise StageFailed(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None
