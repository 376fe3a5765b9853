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
//! # Identity page
//!
//! At [`IDENTITY_PAGE_ADDR`] (0x9e000, below the EBDA, reserved in e820) the
//! VMM writes, at boot and after every snapshot restore, 56 little-endian
//! bytes ([`IDENTITY_LEN`]; the rest of the 4 KiB page is reserved):
//!
//! | offset | field      | contents                                              |
//! |--------|------------|-------------------------------------------------------|
//! | 0      | magic      | ASCII `TORPORID` ([`IDENTITY_MAGIC`] as a u64)        |
//! | 8      | generation | u64: 0 at cold boot, +1 on every restore              |
//! | 16     | seed       | 32 random bytes, fresh at boot and at every restore   |
//! | 48     | clock      | u64: host wall clock at boot/restore, ns since epoch  |
//!
//! so each clone of one snapshot can tell that it was restored and get a
//! seed of its own. [`identity_page`] builds these bytes.
//!
//! # Output (`\n`-terminated lines)
//!
//! With `probe.iters=3` in a 256 MiB guest (`ram_mib` is the e820 RAM in
//! whole MiB, rounded down) on a VMM that writes the identity page:
//!
//! ```text
//! TORPOR-PROBE READY mib=4 iters=3 ticks=1 hz=100 ram_mib=255
//! TORPOR-PROBE IDENTITY gen=0 seed=3f1c09a2d4e5b687 clock_ns=1718000000123456789
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
//! IDENTITY lines: the probe reads the page's generation (volatile loads,
//! in ring 3) right after READY, then at the top of every iteration (after
//! idling) and again just before each ITER line. Whenever the generation
//! differs from the last one it printed (or it has printed none yet) it
//! prints `TORPOR-PROBE IDENTITY gen=<decimal> seed=<hex16> clock_ns=<decimal>`
//! on a line of its own, where `seed` is the first 8 seed bytes read as a
//! little-endian u64. So after a restore during the idle wait the next ITER
//! line is preceded by the new generation's IDENTITY line. Without the magic
//! (a VMM that does not write the page) it prints `TORPOR-PROBE IDENTITY
//! gen=none` once, right after READY, and keeps running; should the magic
//! appear later, the page is reported from then on. IDENTITY lines never
//! change the ITER/DONE sequence; [`parse_identity_line`] reads them.
//!
//! Instead of READY the probe may print
//! `TORPOR-PROBE ERROR workload does not fit in RAM`, and at any time
//! `TORPOR-PROBE FAULT vec=<n> rip=<hex16> err=<hex16> cr2=<hex16>`, each
//! followed by a reset. With the same cmdline and memory size the output is
//! byte-identical on every run apart from IDENTITY lines (the seed and clock
//! are fresh every boot); [`expected_checksums`] predicts the sums.

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

/// What an IDENTITY line reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    /// The page's generation; `None` for `gen=none` (no identity page).
    pub gen: Option<u64>,
    /// The first 8 seed bytes as a little-endian u64 (0 when `gen` is None).
    pub seed: u64,
    /// The host wall clock at boot/restore, ns since the Unix epoch (0 when
    /// `gen` is None).
    pub clock_ns: u64,
}

impl Identity {
    /// What the probe reports for identity page bytes `page` (at least
    /// [`IDENTITY_LEN`] bytes from [`IDENTITY_PAGE_ADDR`]): `gen: None` when
    /// the magic is absent.
    pub fn from_page(page: &[u8]) -> Identity {
        let at = |off: u64| {
            let off = off as usize;
            u64::from_le_bytes(page[off..off + 8].try_into().unwrap())
        };
        if at(IDENTITY_MAGIC_OFFSET) != IDENTITY_MAGIC {
            return Identity {
                gen: None,
                seed: 0,
                clock_ns: 0,
            };
        }
        Identity {
            gen: Some(at(IDENTITY_GEN_OFFSET)),
            seed: at(IDENTITY_SEED_OFFSET),
            clock_ns: at(IDENTITY_CLOCK_OFFSET),
        }
    }
}

/// The bytes the VMM writes at [`IDENTITY_PAGE_ADDR`]: magic, `gen`,
/// `seed`, `clock_ns`, little-endian at the `IDENTITY_*_OFFSET`s.
pub fn identity_page(
    gen: u64,
    seed: &[u8; IDENTITY_SEED_LEN],
    clock_ns: u64,
) -> [u8; IDENTITY_LEN] {
    let mut page = [0u8; IDENTITY_LEN];
    let mut put = |off: u64, bytes: &[u8]| {
        let off = off as usize;
        page[off..off + bytes.len()].copy_from_slice(bytes);
    };
    put(IDENTITY_MAGIC_OFFSET, &IDENTITY_MAGIC.to_le_bytes());
    put(IDENTITY_GEN_OFFSET, &gen.to_le_bytes());
    put(IDENTITY_SEED_OFFSET, seed);
    put(IDENTITY_CLOCK_OFFSET, &clock_ns.to_le_bytes());
    page
}

/// The exact IDENTITY line (without `\n`) the probe prints for `id`.
pub fn identity_line(id: &Identity) -> String {
    match id.gen {
        None => format!("{IDENTITY_PREFIX}gen=none"),
        Some(gen) => format!(
            "{IDENTITY_PREFIX}gen={gen} seed={:016x} clock_ns={}",
            id.seed, id.clock_ns
        ),
    }
}

/// Parses an IDENTITY line; `None` for any other line or a malformed one.
/// `gen=none` gives `Identity { gen: None, seed: 0, clock_ns: 0 }`.
pub fn parse_identity_line(line: &str) -> Option<Identity> {
    let rest = line.trim_end().strip_prefix(IDENTITY_PREFIX)?;
    if rest == "gen=none" {
        return Some(Identity {
            gen: None,
            seed: 0,
            clock_ns: 0,
        });
    }
    let (gen, rest) = rest.strip_prefix("gen=")?.split_once(" seed=")?;
    let (seed, clock_ns) = rest.split_once(" clock_ns=")?;
    let decimal = |s: &str| -> Option<u64> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    let hex_ok = seed.len() == 16
        && seed
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if !hex_ok {
        return None;
    }
    Some(Identity {
        gen: Some(decimal(gen)?),
        seed: u64::from_str_radix(seed, 16).ok()?,
        clock_ns: decimal(clock_ns)?,
    })
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
    fn identity_line_round_trips() {
        let id = Identity {
            gen: Some(7),
            seed: 0x0123_4567_89ab_cdef,
            clock_ns: 1_718_000_000_123_456_789,
        };
        let line = identity_line(&id);
        assert_eq!(
            line,
            "TORPOR-PROBE IDENTITY gen=7 seed=0123456789abcdef clock_ns=1718000000123456789"
        );
        assert_eq!(parse_identity_line(&line), Some(id));
        assert_eq!(parse_identity_line(&format!("{line}\r\n")), Some(id));
        let max = Identity {
            gen: Some(u64::MAX),
            seed: u64::MAX,
            clock_ns: u64::MAX,
        };
        assert_eq!(parse_identity_line(&identity_line(&max)), Some(max));
        let zero = Identity {
            gen: Some(0),
            seed: 0,
            clock_ns: 0,
        };
        assert_eq!(
            identity_line(&zero),
            "TORPOR-PROBE IDENTITY gen=0 seed=0000000000000000 clock_ns=0"
        );
        assert_eq!(parse_identity_line(&identity_line(&zero)), Some(zero));
    }

    #[test]
    fn identity_none_line() {
        let none = Identity {
            gen: None,
            seed: 0,
            clock_ns: 0,
        };
        assert_eq!(identity_line(&none), "TORPOR-PROBE IDENTITY gen=none");
        assert_eq!(
            parse_identity_line("TORPOR-PROBE IDENTITY gen=none\n"),
            Some(none)
        );
    }

    #[test]
    fn identity_parser_rejects_malformed_lines() {
        for bad in [
            "",
            "TORPOR-PROBE IDENTITY",
            "TORPOR-PROBE IDENTITY ",
            "TORPOR-PROBE IDENTITY gen=",
            "TORPOR-PROBE IDENTITY gen=None",
            "TORPOR-PROBE IDENTITY gen=none seed=0000000000000000 clock_ns=0",
            "TORPOR-PROBE IDENTITY gen=1",
            "TORPOR-PROBE IDENTITY gen=1 seed=00000000000000ab",
            "TORPOR-PROBE IDENTITY gen=1 seed=ab clock_ns=5",
            "TORPOR-PROBE IDENTITY gen=1 seed=00000000000000AB clock_ns=5",
            "TORPOR-PROBE IDENTITY gen=1 seed=+0000000000000ab clock_ns=5",
            "TORPOR-PROBE IDENTITY gen=1 seed=00000000000000ab0 clock_ns=5",
            "TORPOR-PROBE IDENTITY gen=+1 seed=00000000000000ab clock_ns=5",
            "TORPOR-PROBE IDENTITY gen=1 seed=00000000000000ab clock_ns=",
            "TORPOR-PROBE IDENTITY gen=1 seed=00000000000000ab clock_ns=5x",
            "TORPOR-PROBE IDENTITY gen=18446744073709551616 seed=00000000000000ab clock_ns=5",
            "TORPOR-PROBE IDENTITY  gen=1 seed=00000000000000ab clock_ns=5",
            "TORPOR-PROBE ITER n=1 sum=0000000000000001",
            "TORPOR-PROBE READY mib=4 iters=3 ticks=1 hz=100 ram_mib=255",
        ] {
            assert_eq!(parse_identity_line(bad), None, "{bad:?}");
        }
        assert_eq!(
            parse_identity_line("TORPOR-PROBE IDENTITY gen=1 seed=00000000000000ab clock_ns=5"),
            Some(Identity {
                gen: Some(1),
                seed: 0xab,
                clock_ns: 5
            })
        );
    }

    #[test]
    fn identity_page_layout() {
        assert_eq!(&IDENTITY_MAGIC.to_le_bytes(), b"TORPORID");
        assert_eq!(IDENTITY_PAGE_ADDR % 4096, 0);
        // Below the EBDA (0x9fc00) and the probe's image, in the first 2 MiB
        // page the probe maps for ring 3.
        const {
            assert!(IDENTITY_PAGE_ADDR + 4096 <= 0x9_fc00);
            assert!(IDENTITY_PAGE_ADDR + 4096 <= LOAD_ADDR);
        }
        assert_eq!(
            IDENTITY_SEED_OFFSET as usize + IDENTITY_SEED_LEN,
            IDENTITY_CLOCK_OFFSET as usize
        );
        assert_eq!(IDENTITY_CLOCK_OFFSET as usize + 8, IDENTITY_LEN);

        let mut seed = [0u8; IDENTITY_SEED_LEN];
        for (i, b) in seed.iter_mut().enumerate() {
            *b = i as u8 + 1;
        }
        let page = identity_page(3, &seed, 1_700_000_000_000_000_000);
        assert_eq!(&page[..8], b"TORPORID");
        assert_eq!(&page[8..16], &3u64.to_le_bytes());
        assert_eq!(&page[16..48], &seed);
        assert_eq!(&page[48..56], &1_700_000_000_000_000_000u64.to_le_bytes());
        let id = Identity::from_page(&page);
        assert_eq!(
            id,
            Identity {
                gen: Some(3),
                seed: 0x0807_0605_0403_0201,
                clock_ns: 1_700_000_000_000_000_000
            }
        );
        assert_eq!(
            identity_line(&id),
            "TORPOR-PROBE IDENTITY gen=3 seed=0807060504030201 clock_ns=1700000000000000000"
        );
        assert_eq!(Identity::from_page(&[0u8; IDENTITY_LEN]).gen, None);
    }

    #[test]
    fn elf_reads_the_identity_page() {
        // The probe's code addresses the page: its absolute address shows up
        // as an imm32/disp32 somewhere in the image.
        let addr = (IDENTITY_PAGE_ADDR as u32).to_le_bytes();
        assert!(PROBE_ELF.windows(4).any(|w| w == addr));
        assert!(PROBE_ELF
            .windows(8)
            .any(|w| w == IDENTITY_MAGIC.to_le_bytes()));
    }

    #[test]
    fn prefixes_share_the_line_prefix() {
        for p in [
            READY_PREFIX,
            IDENTITY_PREFIX,
            ITER_PREFIX,
            DONE_PREFIX,
            ERROR_PREFIX,
            FAULT_PREFIX,
        ] {
            assert!(p.starts_with(LINE_PREFIX) && p.ends_with(' '), "{p:?}");
        }
    }
}
