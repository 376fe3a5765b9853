//! torpor's probe guest: a tiny freestanding x86-64 kernel for VMM tests,
//! built from `guest/` by build.rs with the host's gcc and embedded here as
//! [`PROBE_ELF`].
//!
//! # Boot
//!
//! An ELF loaded like a Linux vmlinux (PT_LOAD at `p_paddr`, linked at
//! [`LOAD_ADDR`], virtual == physical), entered in 64-bit long mode with
//! `rsi` = boot_params. It reads the cmdline and the e820 map from
//! boot_params, prints on COM1 (port 0x3f8) and ends by writing 0xFE to the
//! i8042 command port (0x64), which resets the machine.
//!
//! Ring 0 does 39 instructions of setup (its page tables, GDT, IDT and TSS
//! are static data) before dropping to ring 3, because PVM emulates guest
//! ring 0 slowly; after that it runs only the LAPIC timer handler (6
//! instructions per tick) and the system calls (about 10, plus 6 per tick
//! spent halted).
//!
//! # What PVM allows ring 3 (measured with this probe)
//!
//! - `int n` from ring 3 arrives as #UD (vector 6) whatever the gate, so the
//!   probe's system call is a `ud2` at a known address (`sys_call` in
//!   entry.S) that the #UD handler recognises.
//! - RFLAGS.IOPL=3 does not give ring 3 the I/O ports (in/out raise #GP),
//!   but the TSS I/O permission bitmap does: it opens COM1 (0x3f8-0x3ff) and
//!   the i8042 command port (0x64) only.
//! - CPU exceptions from ring 3, the LAPIC timer and HLT in ring 0 work.
//!
//! # Cmdline (all optional; other words are ignored)
//!
//! | key            | default            | meaning                                   |
//! |----------------|--------------------|-------------------------------------------|
//! | `probe.mib=N`  | [`DEFAULT_MIB`]    | workload size in MiB, at [`WORKLOAD_BASE`] |
//! | `probe.iters=N`| [`DEFAULT_ITERS`]  | iterations before DONE + reset; 0 = forever |
//! | `probe.ticks=N`| [`DEFAULT_TICKS`]  | timer ticks halted between iterations     |
//! | `probe.hz=N`   | [`DEFAULT_HZ`]     | LAPIC timer Hz, clamped to 1..=[`MAX_HZ`] |
//!
//! # Output (`\n`-terminated lines)
//!
//! With `probe.iters=3` in a 256 MiB guest (`ram_mib` is the e820 RAM in
//! whole MiB, rounded down):
//!
//! ```text
//! TORPOR-PROBE READY mib=4 iters=3 ticks=1 hz=100 ram_mib=255
//! TORPOR-PROBE ITER n=1 sum=0000000000000001
//! TORPOR-PROBE ITER n=2 sum=107c7ec2a49e378b
//! TORPOR-PROBE ITER n=3 sum=df43233265090f8d
//! TORPOR-PROBE DONE n=3
//! ```
//!
//! Iteration 1 always prints `sum=0000000000000001`: it reads the region
//! before anything wrote it, so it also checks that fresh guest memory is
//! zero (which a reused VM shell must guarantee).
//!
//! Instead of READY the probe may print
//! `TORPOR-PROBE ERROR workload does not fit in RAM`, and at any time
//! `TORPOR-PROBE FAULT vec=<n> rip=<hex16> err=<hex16> cr2=<hex16>`, each
//! followed by a reset. With the same cmdline and memory size the output is
//! byte-identical on every run; [`expected_checksums`] predicts the sums.

mod abi;

pub use abi::*;

/// The probe guest ELF, ready for the VMM's ELF kernel loader.
pub const PROBE_ELF: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/probe.elf"));

/// Guest-physical address the probe is linked and loaded at (1 MiB).
pub const LOAD_ADDR: u64 = 0x10_0000;

/// The value iteration `n` stores in word `j` of the workload region:
/// splitmix64's finalizer applied to `n << 32 ^ j`.
pub fn mix(n: u64, j: u64) -> u64 {
    let mut z = ((n << 32) ^ j).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Number of 8-byte words in a workload of `mib` MiB.
pub fn workload_words(mib: u32) -> u64 {
    u64::from(mib) << 17
}

/// The checksum the probe prints for iteration `n` (n >= 1).
///
/// The guest starts from `sum = n` and, for every word j in order, folds in
/// the word's old value: `sum = sum.rotate_left(5) ^ old`. The old value is
/// what iteration `n - 1` stored, `mix(n - 1, j)`, or 0 for n = 1 (fresh
/// guest memory is zero), so the sum proves memory survived intact since the
/// previous iteration, e.g. across a snapshot and restore.
pub fn iteration_checksum(mib: u32, n: u64) -> u64 {
    (0..workload_words(mib)).fold(n, |sum, j| {
        let old = if n <= 1 { 0 } else { mix(n - 1, j) };
        sum.rotate_left(5) ^ old
    })
}

/// The sums the probe prints for iterations `1..=count` with `probe.mib=mib`.
pub fn expected_checksums(mib: u32, count: u64) -> Vec<u64> {
    (1..=count).map(|n| iteration_checksum(mib, n)).collect()
}

/// The exact ITER line (without `\n`) for iteration `n` with checksum `sum`.
pub fn iter_line(n: u64, sum: u64) -> String {
    format!("{ITER_PREFIX}n={n} sum={sum:016x}")
}

/// Parses an ITER line into `(n, sum)`; `None` for any other line.
pub fn parse_iter_line(line: &str) -> Option<(u64, u64)> {
    let rest = line.trim_end().strip_prefix(ITER_PREFIX)?;
    let (n, sum) = rest.strip_prefix("n=")?.split_once(" sum=")?;
    if sum.len() != 16 {
        return None;
    }
    Some((n.parse().ok()?, u64::from_str_radix(sum, 16).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u16_at(b: &[u8], off: usize) -> u16 {
        u16::from_le_bytes(b[off..off + 2].try_into().unwrap())
    }
    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }
    fn u64_at(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
    }

    /// (p_type, p_offset, p_paddr, p_filesz, p_memsz) of every program header.
    fn phdrs() -> Vec<(u32, u64, u64, u64, u64)> {
        let e = PROBE_ELF;
        let (phoff, phentsize, phnum) =
            (u64_at(e, 0x20) as usize, u16_at(e, 0x36), u16_at(e, 0x38));
        assert_eq!(phentsize, 56);
        (0..phnum as usize)
            .map(|i| {
                let p = phoff + i * 56;
                (
                    u32_at(e, p),
                    u64_at(e, p + 8),
                    u64_at(e, p + 24),
                    u64_at(e, p + 32),
                    u64_at(e, p + 40),
                )
            })
            .collect()
    }

    #[test]
    fn elf_header_is_x86_64_exec() {
        let e = PROBE_ELF;
        assert_eq!(&e[..4], b"\x7fELF");
        assert_eq!(e[4], 2, "ELFCLASS64");
        assert_eq!(e[5], 1, "little endian");
        assert_eq!(u16_at(e, 0x10), 2, "ET_EXEC");
        assert_eq!(u16_at(e, 0x12), 0x3E, "EM_X86_64");
        let entry = u64_at(e, 0x18);
        assert!(
            (LOAD_ADDR..WORKLOAD_BASE).contains(&entry),
            "entry {entry:#x}"
        );
    }

    #[test]
    fn segments_lie_between_load_addr_and_workload() {
        let loads: Vec<_> = phdrs().into_iter().filter(|p| p.0 == 1).collect();
        assert!(!loads.is_empty());
        assert_eq!(loads.iter().map(|p| p.2).min(), Some(LOAD_ADDR));
        for &(_, off, paddr, filesz, memsz) in &loads {
            assert!(filesz <= memsz);
            assert!(off + filesz <= PROBE_ELF.len() as u64);
            assert!(paddr >= LOAD_ADDR && paddr + memsz <= WORKLOAD_BASE);
        }
        // A PT_NOTE would make linux-loader look for a PVH entry note.
        assert!(phdrs().iter().all(|p| p.0 != 4), "no PT_NOTE expected");
    }

    #[test]
    fn elf_has_no_endbr64() {
        // ENDBR64 (f3 0f 1e fa) could #UD in PVM's ring-0 emulator.
        assert!(!PROBE_ELF.windows(4).any(|w| w == [0xf3, 0x0f, 0x1e, 0xfa]));
    }

    #[test]
    fn mix_known_values() {
        // splitmix64's finalizer at the golden-ratio offset: the first value
        // splitmix64 seeded with 0 produces.
        assert_eq!(mix(0, 0), 0xE220_A839_7B1D_CDAF);
        assert_ne!(mix(1, 0), mix(1, 1));
        assert_ne!(mix(1, 0), mix(2, 0));
    }

    #[test]
    fn first_iteration_reads_zeros() {
        // Zeros only rotate the start value n = 1; 5 * words is a multiple
        // of 64 for any whole MiB, so it comes back to 1.
        for mib in [0, 1, 4] {
            assert_eq!(iteration_checksum(mib, 1), 1);
        }
    }

    #[test]
    fn model_matches_literal_simulation() {
        // Run the guest's algorithm on real memory and compare.
        let mib = 1;
        let mut mem = vec![0u64; workload_words(mib) as usize];
        let mut sums = Vec::new();
        for n in 1..=4u64 {
            let mut sum = n;
            for (j, w) in mem.iter_mut().enumerate() {
                let old = *w;
                *w = mix(n, j as u64);
                sum = sum.rotate_left(5) ^ old;
            }
            sums.push(sum);
        }
        assert_eq!(expected_checksums(mib, 4), sums);
    }

    #[test]
    fn model_pinned_values() {
        // Computed independently (Python) and by the guest's C compiled for
        // the host; pins the algorithm, so a change here is a format change.
        assert_eq!(
            expected_checksums(1, 4),
            [
                0x1,
                0x0d29_c088_d31e_598b,
                0x141b_cd76_49f6_5697,
                0x9ce7_69c6_14f3_ce49
            ]
        );
    }

    #[test]
    fn model_matches_guest_output() {
        // Copied from the guest's serial output under `torpor vmm` with
        // `probe.iters=5` (default 4 MiB).
        assert_eq!(
            expected_checksums(DEFAULT_MIB, 5),
            [
                0x1,
                0x107c_7ec2_a49e_378b,
                0xdf43_2332_6509_0f8d,
                0x387b_4b65_01c6_67c9,
                0xce06_8112_f386_e212
            ]
        );
    }

    #[test]
    fn model_is_deterministic_and_sensitive() {
        let a = expected_checksums(DEFAULT_MIB, 3);
        assert_eq!(a, expected_checksums(DEFAULT_MIB, 3));
        assert_eq!(a.len(), 3);
        assert_ne!(a[1], a[2]);
        assert_ne!(iteration_checksum(1, 2), iteration_checksum(2, 2));
        assert!(expected_checksums(1, 0).is_empty());
    }

    #[test]
    fn iter_line_round_trips() {
        let line = iter_line(12, 0xab);
        assert_eq!(line, "TORPOR-PROBE ITER n=12 sum=00000000000000ab");
        assert_eq!(parse_iter_line(&line), Some((12, 0xab)));
        assert_eq!(parse_iter_line(&format!("{line}\r\n")), Some((12, 0xab)));
        assert_eq!(parse_iter_line("TORPOR-PROBE ITER n=1 sum=ab"), None);
        assert_eq!(parse_iter_line("TORPOR-PROBE DONE n=1"), None);
    }

    #[test]
    fn prefixes_share_the_line_prefix() {
        for p in [
            READY_PREFIX,
            ITER_PREFIX,
            DONE_PREFIX,
            ERROR_PREFIX,
            FAULT_PREFIX,
        ] {
            assert!(p.starts_with(LINE_PREFIX) && p.ends_with(' '), "{p:?}");
        }
    }
}
