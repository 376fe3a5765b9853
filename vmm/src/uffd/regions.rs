//! The guest RAM regions a server covers: validation at start, including a
//! look at what each region actually maps, and the address ↔ page lookups of
//! the fault path.

use std::fs::File;
use std::os::unix::fs::MetadataExt;

use super::{Mode, Region, UffdError, PAGE_SIZE};

/// Validated regions, sorted by host address.
#[derive(Debug)]
pub(crate) struct RegionTable {
    regions: Vec<Region>,
    /// The caller's index of each sorted region, for messages.
    caller_index: Vec<usize>,
    /// Indexes into `regions`, sorted by first page.
    by_page: Vec<usize>,
}

impl RegionTable {
    /// Checks alignment, overflow and overlaps (in host addresses and in
    /// memory-file pages). O(regions log regions).
    pub(crate) fn new(regions: Vec<Region>) -> Result<RegionTable, UffdError> {
        if regions.is_empty() {
            return Err(UffdError::NoRegions);
        }
        for (index, r) in regions.iter().enumerate() {
            let invalid = |reason| UffdError::InvalidRegion {
                index,
                addr: r.host_addr,
                len: r.len,
                first_page: r.first_page,
                reason,
            };
            if r.len == 0 {
                return Err(invalid("it is empty"));
            }
            if r.host_addr % PAGE_SIZE != 0 || r.len % PAGE_SIZE != 0 {
                return Err(invalid("it is not page-aligned"));
            }
            if r.host_addr.checked_add(r.len).is_none() {
                return Err(invalid("it wraps around the address space"));
            }
            let end_byte = r
                .first_page
                .checked_add(r.pages())
                .and_then(|end| end.checked_mul(PAGE_SIZE as u64));
            if end_byte.is_none() {
                return Err(invalid("its page range overflows"));
            }
        }
        let mut order: Vec<usize> = (0..regions.len()).collect();
        order.sort_by_key(|&i| regions[i].host_addr);
        for pair in order.windows(2) {
            let (a, b) = (&regions[pair[0]], &regions[pair[1]]);
            if a.host_addr + a.len > b.host_addr {
                return Err(UffdError::OverlappingRegions {
                    a: pair[0],
                    b: pair[1],
                    what: "host addresses",
                });
            }
        }
        let sorted: Vec<Region> = order.iter().map(|&i| regions[i]).collect();
        let mut by_page: Vec<usize> = (0..sorted.len()).collect();
        by_page.sort_by_key(|&i| sorted[i].first_page);
        for pair in by_page.windows(2) {
            if sorted[pair[0]].end_page() > sorted[pair[1]].first_page {
                return Err(UffdError::OverlappingRegions {
                    a: order[pair[0]],
                    b: order[pair[1]],
                    what: "memory-file pages",
                });
            }
        }
        Ok(RegionTable {
            regions: sorted,
            caller_index: order,
            by_page,
        })
    }

    /// (caller's index, region), in host address order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, &Region)> {
        self.caller_index.iter().copied().zip(&self.regions)
    }

    /// Memory-file page at host address `addr`: O(log regions).
    pub(crate) fn page_at(&self, addr: usize) -> Option<u64> {
        let i = self.regions.partition_point(|r| r.host_addr <= addr);
        let r = self.regions.get(i.checked_sub(1)?)?;
        let off = addr - r.host_addr;
        (off < r.len).then(|| r.first_page + (off / PAGE_SIZE) as u64)
    }

    /// Region holding memory-file page `page`: O(log regions).
    pub(crate) fn region_of_page(&self, page: u64) -> Option<&Region> {
        let i = self
            .by_page
            .partition_point(|&j| self.regions[j].first_page <= page);
        let r = &self.regions[self.by_page[i.checked_sub(1)?]];
        (page < r.end_page()).then_some(r)
    }

    /// Checks in /proc/self/maps that each region is what `mode` needs:
    /// private anonymous memory (missing mode), or a private mapping of
    /// `base` at offset `first_page * PAGE_SIZE` (minor mode). A mapping of
    /// the wrong file or at the wrong offset would not fail: the kernel would
    /// quietly serve the wrong pages. O(host mappings + regions).
    pub(crate) fn check_mappings(
        &self,
        mode: Mode,
        base: &File,
        base_name: &str,
    ) -> Result<(), UffdError> {
        let maps =
            std::fs::read_to_string("/proc/self/maps").map_err(|source| UffdError::Inspect {
                file: "/proc/self/maps".into(),
                source,
            })?;
        let vmas: Vec<Vma> = maps.lines().filter_map(Vma::parse).collect();
        let base_id = match mode {
            Mode::Missing => None,
            Mode::Minor => {
                let meta = base.metadata().map_err(|source| UffdError::Inspect {
                    file: base_name.to_string(),
                    source,
                })?;
                let dev = meta.dev();
                Some(((libc::major(dev), libc::minor(dev)), meta.ino()))
            }
        };
        for (index, r) in self.iter() {
            let wrong = |reason: String| UffdError::WrongMapping {
                index,
                addr: r.host_addr,
                mode: mode.name(),
                reason,
            };
            let end = r.host_addr + r.len;
            let mut at = r.host_addr;
            let first = vmas.partition_point(|v| v.end <= at);
            for v in &vmas[first..] {
                if at >= end {
                    break;
                }
                if v.start > at {
                    break;
                }
                if !v.private {
                    return Err(wrong(format!(
                        "{at:#x} is in a shared mapping; guest RAM must be MAP_PRIVATE"
                    )));
                }
                match base_id {
                    None if v.inode != 0 => {
                        return Err(wrong(format!(
                            "{at:#x} maps a file (device {}:{}, inode {}), not anonymous memory",
                            v.dev.0, v.dev.1, v.inode
                        )));
                    }
                    None => {}
                    Some(id) => {
                        if (v.dev, v.inode) != id {
                            return Err(wrong(format!(
                                "{at:#x} does not map the base memory file {base_name}"
                            )));
                        }
                        let want = r.first_page * PAGE_SIZE as u64 + (at - r.host_addr) as u64;
                        let got = v.offset + (at - v.start) as u64;
                        if got != want {
                            return Err(wrong(format!(
                                "{at:#x} maps offset {got:#x} of the base file, expected \
                                 {want:#x} (page {})",
                                want / PAGE_SIZE as u64
                            )));
                        }
                    }
                }
                at = v.end;
            }
            if at < end {
                return Err(wrong(format!("nothing is mapped at {at:#x}")));
            }
        }
        Ok(())
    }
}

/// One line of /proc/self/maps.
#[derive(Debug, PartialEq, Eq)]
struct Vma {
    start: usize,
    end: usize,
    private: bool,
    offset: u64,
    dev: (u32, u32),
    inode: u64,
}

impl Vma {
    /// `start-end perms offset major:minor inode [path]`, numbers in hex
    /// except the inode.
    fn parse(line: &str) -> Option<Vma> {
        let mut f = line.split_whitespace();
        let (start, end) = f.next()?.split_once('-')?;
        let perms = f.next()?;
        let offset = f.next()?;
        let (major, minor) = f.next()?.split_once(':')?;
        let inode = f.next()?;
        Some(Vma {
            start: usize::from_str_radix(start, 16).ok()?,
            end: usize::from_str_radix(end, 16).ok()?,
            private: perms.ends_with('p'),
            offset: u64::from_str_radix(offset, 16).ok()?,
            dev: (
                u32::from_str_radix(major, 16).ok()?,
                u32::from_str_radix(minor, 16).ok()?,
            ),
            inode: inode.parse().ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(host_addr: usize, pages: usize, first_page: u64) -> Region {
        Region {
            host_addr,
            len: pages * PAGE_SIZE,
            first_page,
        }
    }

    #[test]
    fn lookups() {
        // Given out of order; pages 0..16 at 0x10000, 100..104 at 0x1000.
        let t = RegionTable::new(vec![region(0x10000, 16, 0), region(0x1000, 4, 100)]).unwrap();
        assert_eq!(t.iter().map(|(i, _)| i).collect::<Vec<_>>(), vec![1, 0]);
        assert_eq!(t.page_at(0x1000), Some(100));
        assert_eq!(t.page_at(0x4fff), Some(103));
        assert_eq!(t.page_at(0x5000), None);
        assert_eq!(t.page_at(0xfff), None);
        assert_eq!(t.page_at(0x10000 + 15 * PAGE_SIZE), Some(15));
        assert_eq!(t.page_at(0x10000 + 16 * PAGE_SIZE), None);
        assert_eq!(t.region_of_page(0).unwrap().host_addr, 0x10000);
        assert_eq!(t.region_of_page(15).unwrap().host_addr, 0x10000);
        assert!(t.region_of_page(16).is_none());
        assert_eq!(t.region_of_page(103).unwrap().host_addr, 0x1000);
        assert!(t.region_of_page(104).is_none());
    }

    #[test]
    fn rejects_bad_regions() {
        let bad = |regions: Vec<Region>| RegionTable::new(regions).unwrap_err();
        assert!(matches!(bad(vec![]), UffdError::NoRegions));
        let e = bad(vec![region(0x1000, 0, 0)]);
        assert!(e.to_string().contains("empty"), "{e}");
        let e = bad(vec![region(0x1008, 1, 0)]);
        assert!(e.to_string().contains("page-aligned"), "{e}");
        let e = bad(vec![region(usize::MAX - 0xfff, 2, 0)]);
        assert!(e.to_string().contains("wraps"), "{e}");
        let e = bad(vec![region(0x1000, 2, u64::MAX - 1)]);
        assert!(e.to_string().contains("overflows"), "{e}");
        let e = bad(vec![region(0x1000, 4, 0), region(0x4000, 4, 10)]);
        assert!(
            matches!(
                e,
                UffdError::OverlappingRegions {
                    a: 0,
                    b: 1,
                    what: "host addresses"
                }
            ),
            "{e}"
        );
        let e = bad(vec![region(0x10000, 4, 10), region(0x1000, 4, 12)]);
        assert!(
            matches!(e, UffdError::OverlappingRegions { a: 0, b: 1, .. }),
            "{e}"
        );
    }

    #[test]
    fn parses_maps_lines() {
        let v =
            Vma::parse("7f1c2a000000-7f1c2a800000 rw-p 00001000 00:01 4242   /memfd:t (deleted)")
                .unwrap();
        assert_eq!(
            v,
            Vma {
                start: 0x7f1c2a000000,
                end: 0x7f1c2a800000,
                private: true,
                offset: 0x1000,
                dev: (0, 1),
                inode: 4242
            }
        );
        let v = Vma::parse("7ffd1000-7ffd3000 rw-s 00000000 fd:1a 0").unwrap();
        assert!(!v.private);
        assert_eq!(v.dev, (0xfd, 0x1a));
        assert!(Vma::parse("garbage").is_none());
    }
}
