"""A host's GPU leases as a pool of hosts sees them: how many are held, which are free, and a claim on one.

A lease is the supervisor's `flock` on `<gpu_lock_dir>/gpu<N>.lock` (see `launch.py`). A job of a pool
(`sweep.hosts`) chooses its host before it connects, checks and syncs there, so between its choice and its
supervisor's lease a few seconds pass in which jobs choosing at the same time would all see the same GPU
free. The choice therefore claims the GPU: a reservation, `<gpu_lock_dir>/gpu<N>.reserved.<uid>` holding the
unix time it lapses (claim time + a timeout covering the launch). GPU N is reserved while the newest of its
reservation files holds a time still ahead; the supervisor that leases GPU N writes 0 into its own user's
file, so the newest says "taken" whoever made the claim (the folder is sticky: no user can change or remove
another's files). A claim whose job never launches (it failed before, or was cancelled) lapses by itself.

A host without GPUs to lease (`gpus: none`, or `auto` where `nvidia-smi -L` lists none) never makes a job
wait; its load is its live workers in `host.workdir` plus its claims not yet lapsed
(`host.reserved.<uid>.<time>.<pid>` files), so that jobs starting at once spread over such hosts too.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config.handover import sh_write_whole
from orchestrator.host.transport import Transport

RESERVED = "reserved"
POOL_LOCK = "pool.lock"
PROBE_LOCK_WAIT_S = 30  # another job's probe holds the pool lock for milliseconds; this long means trouble

# A claim is written whole (a probe reading one half written took the GPU as free), by way of a scratch
# file that no probe's glob matches.
GPU_CLAIM = f'"$locks/gpu$g.{RESERVED}.$me"'
_HOST_CLAIM = f'"$locks/host.{RESERVED}.$me.$now.$$"'
CLAIM_SCRATCH = '"$locks/.claim.$(id -u).$$"'
TAKEN = f'"$locks/gpu$lease.{RESERVED}.$(id -u)"'  # the supervisor's "0": the GPU's claim is now its lease

# A fixed script; values are positional: $1 the lock folder, $2 the candidates ("0 1", auto or none), $3 the
# work dir, $4 how long a claim lasts (s), $5 claim (1) or only look (0). Under the host's pool lock (so two
# probes never claim the same GPU), each candidate's lease is tried without blocking and let go at once.
# Lock files are opened read-only (never O_CREAT on another user's file: fs.protected_regular refuses it).
# A host without GPUs to lease needs neither flock nor a usable lock folder: its claims are only for balance.
# Prints `gpus`, `busy`, `reserved`, `free`, `running` lines and, when claiming, `claimed <gpu|host|none>`.
_PROBE = (
    "locks=$1; gpus=$2; workdir=$3; ttl=$4; claim=$5; me=$(id -u); "
    "case $gpus in auto) gpus=$(nvidia-smi -L 2>/dev/null | sed -n 's/^GPU \\([0-9][0-9]*\\):.*/\\1/p' "
    "| tr '\\n' ' ');; none) gpus=;; esac; "
    'echo "gpus $gpus"; '
    "if ! command -v flock >/dev/null 2>&1; then "
    '[ -z "$gpus" ] || { echo "error the flock command (util-linux) is missing"; exit 3; }; else '
    '[ -d "$locks" ] || { mkdir -p "$locks" && chmod 1777 "$locks"; } 2>/dev/null; '
    f'p="$locks/{POOL_LOCK}"; [ -e "$p" ] || (umask 0; : >> "$p") 2>/dev/null; '
    f'if [ -r "$p" ]; then exec 9<"$p"; flock -w {PROBE_LOCK_WAIT_S} 9 || '
    '{ echo "error $p stayed locked"; exit 4; }; '
    'elif [ -n "$gpus" ]; then echo "error cannot read $p"; exit 3; fi; fi; '
    "now=$(date +%s); busy=0; reserved=0; free=; running=0; "
    "for g in $gpus; do "
    'f="$locks/gpu$g.lock"; [ -e "$f" ] || (umask 0; : >> "$f") 2>/dev/null; '
    '[ -r "$f" ] || { echo "error cannot read $f"; exit 3; }; exec 8<"$f"; '
    "if flock -n 8; then exec 8<&-; "
    f'r=$(ls -t "$locks/gpu$g.{RESERVED}".* 2>/dev/null | head -n 1); ends=0; '
    '[ -n "$r" ] && ends=$(cat "$r" 2>/dev/null); '
    "case $ends in ''|*[!0-9]*) ends=0;; esac; "
    'if [ "$ends" -gt "$now" ]; then reserved=$((reserved + 1)); else free="$free $g"; fi; '
    "else exec 8<&-; busy=$((busy + 1)); fi; done; "
    'if [ -z "$gpus" ]; then '
    'for p in "$workdir"/runs/*/pid; do [ -f "$p" ] || continue; [ -f "${p%/pid}/exit_code" ] && continue; '
    "pid=$(dd if=\"$p\" iflag=nofollow,nonblock status=none 2>/dev/null); case $pid in ''|*[!0-9]*) continue;; esac; "
    'kill -0 -"$pid" 2>/dev/null && running=$((running + 1)); done; '
    f'for r in "$locks/host.{RESERVED}".*; do [ -f "$r" ] || continue; ends=$(cat "$r" 2>/dev/null); '
    "case $ends in ''|*[!0-9]*) ends=0;; esac; "
    'if [ "$ends" -gt "$now" ]; then reserved=$((reserved + 1)); '
    f'else case $r in "$locks/host.{RESERVED}.$me".*) rm -f "$r";; esac; fi; done; fi; '
    'echo "busy $busy"; echo "reserved $reserved"; echo "free$free"; echo "running $running"; '
    '[ "$claim" = 1 ] || exit 0; '
    'if [ -z "$gpus" ]; then '
    f"{sh_write_whole('$((now + ttl))', _HOST_CLAIM, CLAIM_SCRATCH)} 2>/dev/null; "
    'echo "claimed host"; exit 0; fi; '
    "for g in $free; do "
    f"{sh_write_whole('$((now + ttl))', GPU_CLAIM, CLAIM_SCRATCH)} && "
    '{ echo "claimed $g"; exit 0; }; done; '
    'echo "claimed none"'
)


class ProbeFailed(RuntimeError):
    """The host answered, but its leases could not be read (no flock, a lock folder it cannot use)."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient  # the pool lock stayed held: worth another look later


@dataclass(frozen=True)
class Leases:
    """One look at a host's leases (and, when asked, a claim on one)."""

    gpus: tuple[int, ...]  # the candidates: host.gpus, `auto` as the host counts them; () when none
    busy: int = 0  # leased now, by anyone
    reserved: int = 0  # free but claimed by a job about to start there (lease hosts); claims not lapsed (others)
    free: tuple[int, ...] = ()  # free and unclaimed, in the order of `gpus`
    running: int = 0  # a host without leases: this user's live workers in host.workdir
    claimed: int | str | None = None  # the GPU claimed, "host" on a host without leases, None: nothing

    @property
    def leased(self) -> bool:
        return bool(self.gpus)

    @property
    def load(self) -> int:
        """The jobs running there or about to: what the pool orders its hosts by (fewest first)."""
        return self.busy + self.reserved if self.leased else self.running + self.reserved

    @property
    def available(self) -> bool:
        """A job sent there now would not wait (a host without leases never makes it wait)."""
        return bool(self.free) or not self.leased


def probe_leases(
    transport: Transport, gpus: str | list[int], locks_dir: str, workdir: str, claim_s: float, claim: bool
) -> Leases:
    """Look at the host's leases; with `claim`, also claim the first free GPU for `claim_s` seconds."""
    candidates = gpus if isinstance(gpus, str) else " ".join(str(int(g)) for g in gpus)
    argv = ["sh", "-c", _PROBE, "lease-probe", locks_dir, candidates, workdir, str(int(claim_s)), str(int(claim))]
    result = transport.run(argv, check=False)
    return parse_probe(result.exit_code, result.stdout, result.stderr)


def parse_probe(exit_code: int, stdout: str, stderr: str = "") -> Leases:
    answer: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        key, _, value = line.strip().partition(" ")
        answer[key] = value.split()
    if exit_code != 0 or "busy" not in answer:
        said = " ".join(answer.get("error", [])) or (stderr.strip().splitlines() or ["no answer"])[-1]
        raise ProbeFailed(f"cannot read its GPU leases: {said}", transient=exit_code == 4)
    claimed_words = answer.get("claimed") or ["none"]
    claimed: int | str | None = None
    if claimed_words[0].isdigit():
        claimed = int(claimed_words[0])
    elif claimed_words[0] == "host":
        claimed = "host"
    return Leases(
        gpus=tuple(int(g) for g in answer.get("gpus", [])),
        busy=int(answer["busy"][0]),
        reserved=int(answer.get("reserved", ["0"])[0]),
        free=tuple(int(g) for g in answer.get("free", [])),
        running=int(answer.get("running", ["0"])[0]),
        claimed=claimed,
    )
