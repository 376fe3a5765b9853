//! A sparse file's data extents (`SEEK_DATA`/`SEEK_HOLE`): what copies of
//! memory files keep (holes stay holes) and what a disk overlay reused
//! after a reboot holds (its chunks are the extents written).

use std::fs::File;
use std::os::fd::AsRawFd;

/// The `(offset, length)` extents of `file`'s first `len` bytes that hold
/// data, in order. A filesystem without hole reporting answers one extent
/// to the end (Linux's generic `SEEK_DATA`): callers that rely on holes
/// compare with [`allocated_bytes`].
pub fn data_extents(file: &File, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let end = i64::try_from(len).map_err(|_| std::io::Error::other("file too large"))?;
    let mut out = Vec::new();
    let mut pos = 0i64;
    while pos < end {
        // SAFETY: lseek on a file descriptor `file` owns; no memory is involved.
        let data = unsafe { libc::lseek(file.as_raw_fd(), pos, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // No data after `pos`.
            }
            return Err(e);
        }
        if data >= end {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), data, libc::SEEK_HOLE) };
        let stop = if hole < 0 { end } else { hole.min(end) };
        out.push((data as u64, (stop - data) as u64));
        pos = stop;
    }
    Ok(out)
}

/// Bytes the filesystem has allocated for `file` (`st_blocks`).
pub fn allocated_bytes(file: &File) -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(file.metadata()?.blocks().saturating_mul(512))
}

/// Copies only the data extents of `src`'s first `len` bytes into `dst`
/// (sized to `len`), so holes stay holes: zero pages of a memory file cost
/// no shmem, and a disk overlay's copy holds the chunks the original does.
pub fn copy_sparse(src: &File, dst: &mut File, len: u64) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    dst.set_len(len)?;
    let mut buf = vec![0u8; 1 << 20];
    for (start, size) in data_extents(src, len)? {
        let (mut off, end) = (start, start + size);
        while off < end {
            let n = ((end - off) as usize).min(buf.len());
            src.read_exact_at(&mut buf[..n], off)?;
            dst.write_all_at(&buf[..n], off)?;
            off += n as u64;
        }
    }
    dst.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn extents_are_the_written_ranges_of_a_sparse_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        let len = 1 << 24;
        f.set_len(len).unwrap();
        assert!(data_extents(&f, len).unwrap().is_empty());
        f.write_all_at(&[1; 4096], 1 << 20).unwrap();
        f.write_all_at(&[2; 8192], 8 << 20).unwrap();
        let extents = data_extents(&f, len).unwrap();
        // Filesystems may round extents out to their block size; what was
        // written is inside them, and nothing near the start is data.
        assert_eq!(extents.len(), 2, "{extents:?}");
        assert!(extents[0].0 <= 1 << 20 && extents[0].0 + extents[0].1 >= (1 << 20) + 4096);
        assert!(extents[1].0 <= 8 << 20 && extents[1].0 + extents[1].1 >= (8 << 20) + 8192);
        assert!(allocated_bytes(&f).unwrap() >= 12288);

        // A copy holds the same bytes and the same extents (a disk
        // overlay's copy holds the same chunks).
        let mut copy = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("copy"))
            .unwrap();
        copy_sparse(&f, &mut copy, len).unwrap();
        assert_eq!(copy.metadata().unwrap().len(), len);
        assert_eq!(data_extents(&copy, len).unwrap(), extents);
        let (mut a, mut b) = (vec![0u8; 8192], vec![0u8; 8192]);
        for at in [0, 1 << 20, 8 << 20] {
            f.read_exact_at(&mut a, at).unwrap();
            copy.read_exact_at(&mut b, at).unwrap();
            assert_eq!(a, b, "at {at}");
        }
    }
}
