//! Sparse files: where a file's data is (`SEEK_DATA`/`SEEK_HOLE`), so an
//! upload reads only that and a multi-GiB memory file that is mostly holes
//! costs what its data does; and writing a chunk back with its zero pages
//! left as holes, as the snapshot writer made them.

use rustix::fs::SeekFrom;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;

use rustix::io::Errno;

/// The page size holes are kept at on download.
const PAGE: usize = 4096;

/// The data ranges of `file` (of length `len`), in order. Where the file
/// system does not tell, the whole file is data.
pub(crate) fn data_ranges(file: &File, len: u64) -> std::io::Result<Vec<Range<u64>>> {
    let mut out = Vec::new();
    let mut at = 0u64;
    while at < len {
        let start = match rustix::fs::seek(file, SeekFrom::Data(at)) {
            Ok(s) => s,
            // No data past `at`.
            Err(Errno::NXIO) => break,
            // No SEEK_DATA here: all of it is data.
            Err(Errno::INVAL) | Err(Errno::OPNOTSUPP) if at == 0 => {
                out.push(0..len);
                return Ok(out);
            }
            Err(e) => return Err(e.into()),
        };
        if start >= len {
            break;
        }
        let end = match rustix::fs::seek(file, SeekFrom::Hole(start)) {
            Ok(e) => e.min(len),
            Err(Errno::NXIO) => len,
            Err(e) => return Err(e.into()),
        };
        let end = end.max(start + 1);
        out.push(start..end);
        at = end;
    }
    Ok(out)
}

/// Which of `count` chunks of `chunk_size` bytes hold any of `ranges`.
pub(crate) fn chunks_with_data(ranges: &[Range<u64>], chunk_size: u64, count: u64) -> Vec<bool> {
    let mut out = vec![false; count as usize];
    for r in ranges {
        let first = r.start / chunk_size;
        let last = (r.end - 1) / chunk_size;
        for i in first..=last.min(count.saturating_sub(1)) {
            out[i as usize] = true;
        }
    }
    out
}

/// Writes `data` at `offset` of `file`, leaving its all-zero pages
/// unwritten (holes, in a file made at its length): each run of non-zero
/// pages is one write.
pub(crate) fn write_sparse(file: &File, offset: u64, data: &[u8]) -> std::io::Result<()> {
    let mut run: Option<usize> = None;
    let mut pos = 0;
    while pos < data.len() {
        let end = (pos + PAGE).min(data.len());
        let zero = crate::chunk::is_zero(&data[pos..end]);
        match (zero, run) {
            (false, None) => run = Some(pos),
            (true, Some(start)) => {
                file.write_all_at(&data[start..pos], offset + start as u64)?;
                run = None;
            }
            _ => {}
        }
        pos = end;
    }
    if let Some(start) = run {
        file.write_all_at(&data[start..], offset + start as u64)?;
    }
    Ok(())
}

/// Bytes allocated on disk under `path` (what `du` counts: a sparse
/// file's holes cost nothing; a directory is walked, links not followed).
/// What cannot be read counts 0.
pub fn allocated_bytes(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    let own = m.blocks() * 512;
    if !m.is_dir() {
        return own;
    }
    let entries = std::fs::read_dir(path).into_iter().flatten().flatten();
    own + entries.map(|e| allocated_bytes(&e.path())).sum::<u64>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn holes_are_found_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse");
        let f = File::create(&path).unwrap();
        let len = 64 << 20;
        f.set_len(len).unwrap();
        f.write_all_at(&[1u8; 8192], 10 << 20).unwrap();
        f.write_all_at(&[2u8; 100], len - 100).unwrap();
        let ranges = data_ranges(&f, len).unwrap();
        // File systems report data at their own block granularity.
        assert!(!ranges.is_empty() && ranges.len() <= 2, "{ranges:?}");
        assert!(ranges.iter().any(|r| r.contains(&(10 << 20))), "{ranges:?}");
        assert!(ranges.iter().any(|r| r.contains(&(len - 1))), "{ranges:?}");
        let marks = chunks_with_data(&ranges, 1 << 20, 64);
        assert!(marks[10] && marks[63]);
        assert!(marks.iter().filter(|m| **m).count() <= 4, "{marks:?}");

        // A chunk with a zero page in the middle is written as two runs.
        let out = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("out"))
            .unwrap();
        out.set_len(len).unwrap();
        let mut chunk = vec![3u8; 3 * PAGE];
        chunk[PAGE..2 * PAGE].fill(0);
        write_sparse(&out, 0, &chunk).unwrap();
        out.sync_all().unwrap();
        let mut back = vec![9u8; 3 * PAGE];
        out.read_exact_at(&mut back, 0).unwrap();
        assert_eq!(back, chunk);
        assert!(out.metadata().unwrap().blocks() * 512 <= 2 * PAGE as u64 + 8192);
    }
}
