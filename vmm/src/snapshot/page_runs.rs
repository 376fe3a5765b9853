//! Sets of guest pages as sorted runs, the compact form in which a diff
//! layer records which pages it holds.

use serde::{Deserialize, Serialize};

/// A set of page indexes kept as sorted, non-overlapping, coalesced runs of
/// `(first_page, count)`; no run is empty and no two runs touch.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct PageRuns {
    runs: Vec<(u64, u64)>,
}

impl PageRuns {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds the set from page indexes in ascending order (duplicates are
    /// fine). Out-of-order input is still handled correctly, only slower.
    pub fn from_sorted_pages<I: IntoIterator<Item = u64>>(pages: I) -> Self {
        let mut runs = PageRuns::new();
        for p in pages {
            runs.push_run(p, 1);
        }
        runs
    }

    /// Builds the set from a dirty bitmap laid out as KVM's
    /// `KVM_GET_DIRTY_LOG` returns it: bit `i` of `words[w]` is page
    /// `base_page + w * 64 + i`.
    pub fn from_bitmap(words: &[u64], base_page: u64) -> Self {
        let mut runs = PageRuns::new();
        for (w, &word) in words.iter().enumerate() {
            let mut bits = word;
            let mut shift = 0u32;
            while bits != 0 {
                let zeros = bits.trailing_zeros();
                bits >>= zeros;
                shift += zeros;
                // `bits` now ends in a run of ones; `ones` <= 64 - shift.
                let ones = bits.trailing_ones();
                let first = base_page + w as u64 * 64 + shift as u64;
                runs.push_run(first, ones as u64);
                bits = bits.checked_shr(ones).unwrap_or(0);
                shift += ones;
            }
        }
        runs
    }

    /// Adds pages `first..first + count`. Appending in ascending order is
    /// O(1) and coalesces with the last run; anything else is merged in.
    pub fn push_run(&mut self, first: u64, count: u64) {
        if count == 0 {
            return;
        }
        let end = first.saturating_add(count);
        match self.runs.last_mut() {
            None => self.runs.push((first, end - first)),
            Some(last) if first >= last.0 => {
                let last_end = last.0 + last.1;
                if first > last_end {
                    self.runs.push((first, end - first));
                } else if end > last_end {
                    last.1 = end - last.0;
                }
            }
            Some(_) => {
                *self = self.union(&PageRuns {
                    runs: vec![(first, end - first)],
                })
            }
        }
    }

    /// Whether `page` is in the set: a binary search over the runs.
    pub fn contains(&self, page: u64) -> bool {
        let i = self.runs.partition_point(|&(first, _)| first <= page);
        i > 0 && {
            let (first, count) = self.runs[i - 1];
            page - first < count
        }
    }

    /// Number of pages in the set.
    pub fn page_count(&self) -> u64 {
        self.runs.iter().map(|&(_, count)| count).sum()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// The runs, ascending.
    pub fn runs(&self) -> &[(u64, u64)] {
        &self.runs
    }

    /// One past the highest page in the set (0 if empty).
    pub fn end_page(&self) -> u64 {
        self.runs.last().map_or(0, |&(first, count)| first + count)
    }

    /// Every page in the set, ascending.
    pub fn iter_pages(&self) -> impl Iterator<Item = u64> + '_ {
        self.runs
            .iter()
            .flat_map(|&(first, count)| first..first + count)
    }

    /// The pages in either set.
    pub fn union(&self, other: &PageRuns) -> PageRuns {
        let mut out = PageRuns {
            runs: Vec::with_capacity(self.runs.len() + other.runs.len()),
        };
        let (mut a, mut b) = (self.runs.iter().peekable(), other.runs.iter().peekable());
        loop {
            let next = match (a.peek(), b.peek()) {
                (Some(&&x), Some(&&y)) if x.0 <= y.0 => a.next(),
                (Some(_), Some(_)) => b.next(),
                (Some(_), None) => a.next(),
                (None, Some(_)) => b.next(),
                (None, None) => break,
            };
            let &(first, count) = next.unwrap();
            // Inputs are sorted, so this always takes push_run's fast path.
            out.push_run(first, count);
        }
        out
    }

    /// Whether the invariants hold (sorted, non-empty runs, not touching,
    /// no overflow). Worth checking on a set decoded from a file.
    pub fn is_well_formed(&self) -> bool {
        let mut prev_end: Option<u64> = None;
        for &(first, count) in &self.runs {
            let Some(end) = first.checked_add(count) else {
                return false;
            };
            if count == 0 || prev_end.is_some_and(|e| first <= e) {
                return false;
            }
            prev_end = Some(end);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive_from_bitmap(words: &[u64], base: u64) -> Vec<u64> {
        let mut pages = Vec::new();
        for (w, &word) in words.iter().enumerate() {
            for i in 0..64 {
                if word & (1 << i) != 0 {
                    pages.push(base + w as u64 * 64 + i);
                }
            }
        }
        pages
    }

    /// A small deterministic generator (xorshift) for randomized checks.
    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed | 1;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    #[test]
    fn from_sorted_pages_coalesces() {
        let r = PageRuns::from_sorted_pages([1, 2, 3, 3, 5, 10, 11, 12, 13]);
        assert_eq!(r.runs(), &[(1, 3), (5, 1), (10, 4)]);
        assert_eq!(r.page_count(), 8);
        assert_eq!(r.end_page(), 14);
        assert!(r.is_well_formed());
        let pages: Vec<u64> = r.iter_pages().collect();
        assert_eq!(pages, vec![1, 2, 3, 5, 10, 11, 12, 13]);
    }

    #[test]
    fn unsorted_pages_are_still_a_correct_set() {
        let r = PageRuns::from_sorted_pages([9, 3, 4, 1, 2, 8, 100]);
        assert_eq!(r.runs(), &[(1, 4), (8, 2), (100, 1)]);
        assert!(r.is_well_formed());
    }

    #[test]
    fn push_run_merges_overlaps_and_neighbours() {
        let mut r = PageRuns::new();
        r.push_run(10, 5); // 10..15
        r.push_run(15, 5); // touches: 10..20
        r.push_run(12, 3); // inside
        r.push_run(18, 10); // overlaps the end: 10..28
        r.push_run(30, 0); // empty: ignored
        r.push_run(0, 3); // before: slow path
        r.push_run(3, 7); // bridges 0..3 and 10..28
        assert_eq!(r.runs(), &[(0, 28)]);
    }

    #[test]
    fn from_bitmap_matches_bit_layout() {
        let words = [0b1011u64, 0, u64::MAX, 1 << 63, 1, 0x8000_0000_0000_0001];
        let r = PageRuns::from_bitmap(&words, 1000);
        let want = naive_from_bitmap(&words, 1000);
        assert_eq!(r.iter_pages().collect::<Vec<_>>(), want);
        // Runs coalesce across words: bit 63 of word 3 (page 1255) and bit 0
        // of word 4 (page 1256) are one run.
        assert_eq!(
            r.runs(),
            &[
                (1000, 2),
                (1003, 1),
                (1128, 64),
                (1255, 2),
                (1320, 1),
                (1383, 1)
            ]
        );
        assert!(r.is_well_formed());
    }

    #[test]
    fn from_bitmap_randomized_against_naive() {
        let mut next = rng(0x5eed);
        for round in 0..200 {
            let words: Vec<u64> = (0..(round % 17))
                .map(|_| match next() % 4 {
                    0 => 0,
                    1 => u64::MAX,
                    _ => next() & next(),
                })
                .collect();
            let r = PageRuns::from_bitmap(&words, round * 3);
            assert_eq!(
                r.iter_pages().collect::<Vec<_>>(),
                naive_from_bitmap(&words, round * 3)
            );
            assert!(r.is_well_formed());
        }
    }

    #[test]
    fn contains_agrees_with_the_page_list() {
        let mut next = rng(42);
        let mut pages: Vec<u64> = (0..500).map(|_| next() % 5000).collect();
        pages.sort_unstable();
        let r = PageRuns::from_sorted_pages(pages.iter().copied());
        for p in 0..5100 {
            assert_eq!(r.contains(p), pages.binary_search(&p).is_ok(), "page {p}");
        }
        assert!(!PageRuns::new().contains(0));
    }

    #[test]
    fn union_is_the_set_union() {
        let mut next = rng(7);
        for _ in 0..100 {
            let a: Vec<u64> = (0..50).map(|_| next() % 300).collect();
            let b: Vec<u64> = (0..50).map(|_| next() % 300).collect();
            let ra = PageRuns::from_sorted_pages(a.iter().copied());
            let rb = PageRuns::from_sorted_pages(b.iter().copied());
            let mut all: Vec<u64> = a.into_iter().chain(b).collect();
            all.sort_unstable();
            all.dedup();
            let u = ra.union(&rb);
            assert_eq!(u.iter_pages().collect::<Vec<_>>(), all);
            assert!(u.is_well_formed());
            assert_eq!(u, rb.union(&ra));
        }
    }

    #[test]
    fn serde_round_trip_and_well_formedness() {
        let r = PageRuns::from_sorted_pages([1, 2, 7]);
        let bytes = bincode::serialize(&r).unwrap();
        assert_eq!(bincode::deserialize::<PageRuns>(&bytes).unwrap(), r);
        let bad: PageRuns =
            bincode::deserialize(&bincode::serialize(&vec![(5u64, 1u64), (2, 1)]).unwrap())
                .unwrap();
        assert!(!bad.is_well_formed());
        let touching = PageRuns {
            runs: vec![(1, 2), (3, 1)],
        };
        assert!(!touching.is_well_formed());
    }
}
