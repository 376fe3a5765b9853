// The probe's external contract: cmdline keys, defaults, line prefixes.
//
// One source of truth for both sides: build.rs pulls this file in with
// include! and writes it out as `probe_abi.h` for the guest's C and assembly,
// and lib.rs re-exports it for host tests. So only `//` comments up here
// (an inner `//!` doc would not survive include!).

/// Every line the probe prints starts with this.
pub const LINE_PREFIX: &str = "TORPOR-PROBE ";
/// `TORPOR-PROBE READY mib=<N> iters=<N> ticks=<N> hz=<N> ram_mib=<N>`:
/// printed once, after setup, with the effective parameters and the total
/// RAM the e820 map reports (whole MiB, rounded down).
pub const READY_PREFIX: &str = "TORPOR-PROBE READY ";
/// `TORPOR-PROBE ITER n=<N> sum=<16 lowercase hex digits>`: one per
/// iteration, n = 1, 2, 3, ...; see [`crate::iteration_checksum`].
pub const ITER_PREFIX: &str = "TORPOR-PROBE ITER ";
/// `TORPOR-PROBE DONE n=<N>`: after `probe.iters` iterations, right before
/// the probe resets the machine through the i8042.
pub const DONE_PREFIX: &str = "TORPOR-PROBE DONE ";
/// `TORPOR-PROBE IDENTITY gen=<N> seed=<16 lowercase hex digits> clock_ns=<N>`,
/// or `TORPOR-PROBE IDENTITY gen=none`: what the identity page (see
/// [`IDENTITY_PAGE_ADDR`]) holds. Printed right after READY and then, before
/// an ITER line, whenever the page's generation differs from the one last
/// printed; `seed` is the first 8 seed bytes as a little-endian u64.
/// `gen=none` (no magic) is printed at most once per boot; see
/// [`crate::parse_identity_line`].
pub const IDENTITY_PREFIX: &str = "TORPOR-PROBE IDENTITY ";
/// `TORPOR-PROBE ERROR <text>`: the probe cannot run and resets.
pub const ERROR_PREFIX: &str = "TORPOR-PROBE ERROR ";
/// The exact text after [`ERROR_PREFIX`] when the workload region
/// (`WORKLOAD_BASE`, `probe.mib` MiB) is not entirely e820 RAM below 4 GiB.
pub const ERROR_NO_FIT: &str = "workload does not fit in RAM";
/// `TORPOR-PROBE FAULT vec=<N> rip=<hex16> err=<hex16> cr2=<hex16>`: a CPU
/// exception (vector 0-31) reached the probe; it resets right after.
pub const FAULT_PREFIX: &str = "TORPOR-PROBE FAULT ";

/// Cmdline key: workload size in MiB.
pub const PARAM_MIB: &str = "probe.mib";
/// Cmdline key: iterations before DONE and reset; 0 runs forever.
pub const PARAM_ITERS: &str = "probe.iters";
/// Cmdline key: timer ticks spent halted (HLT) between iterations.
pub const PARAM_TICKS: &str = "probe.ticks";
/// Cmdline key: LAPIC timer frequency in Hz, clamped to 1..=[`MAX_HZ`].
pub const PARAM_HZ: &str = "probe.hz";

/// Default of `probe.mib`.
pub const DEFAULT_MIB: u32 = 4;
/// Default of `probe.iters` (forever).
pub const DEFAULT_ITERS: u64 = 0;
/// Default of `probe.ticks`.
pub const DEFAULT_TICKS: u64 = 1;
/// Default of `probe.hz`.
pub const DEFAULT_HZ: u32 = 100;
/// Upper clamp of `probe.hz`: every tick costs emulated ring-0 instructions
/// under PVM, so the timer must stay slow.
pub const MAX_HZ: u32 = 10_000;

/// Guest-physical address where the workload region starts (16 MiB).
pub const WORKLOAD_BASE: u64 = 16 << 20;

/// Guest-physical address of the identity page, which the VMM writes at boot
/// and after every snapshot restore so that each clone of one snapshot can
/// tell it was restored and get a seed of its own. It lies in conventional
/// memory below the EBDA; the VMM reserves it in the e820 map. Layout
/// (little-endian): magic, generation, seed, clock; see the `IDENTITY_*`
/// offsets. The probe maps it for ring 3 (identity-mapped, user pages).
pub const IDENTITY_PAGE_ADDR: u64 = 0x9e000;
/// Offset of the magic, 8 bytes: ASCII "TORPORID".
pub const IDENTITY_MAGIC_OFFSET: u64 = 0;
/// [`IDENTITY_MAGIC_OFFSET`]'s 8 bytes read as a little-endian u64.
pub const IDENTITY_MAGIC: u64 = 0x4449_524f_5052_4f54;
/// Offset of the generation, u64: 0 at cold boot, incremented by the VMM on
/// every restore.
pub const IDENTITY_GEN_OFFSET: u64 = 8;
/// Offset of the seed: [`IDENTITY_SEED_LEN`] random bytes, fresh at boot and
/// at every restore.
pub const IDENTITY_SEED_OFFSET: u64 = 16;
/// Length of the seed in bytes.
pub const IDENTITY_SEED_LEN: usize = 32;
/// Offset of the host's wall clock at boot or restore, u64 nanoseconds since
/// the Unix epoch.
pub const IDENTITY_CLOCK_OFFSET: u64 = 48;
/// Bytes of the page in use (magic through clock); the rest of the 4 KiB
/// page is reserved (the VMM should leave it zero).
pub const IDENTITY_LEN: usize = 56;
