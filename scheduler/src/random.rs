//! Random bytes from the kernel's CSPRNG: ids, temp names, tokens, DNS
//! query ids.

use std::io;

/// Fills `buf` from the kernel's CSPRNG (getrandom(2), blocking only until
/// the pool is initialised at boot).
pub fn random_bytes(buf: &mut [u8]) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: the pointer and length describe `rest`, a live, writable slice.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        filled += n as usize;
    }
    Ok(())
}

/// `bytes` random bytes as lowercase hex (2 × `bytes` characters).
///
/// # Panics
/// If getrandom(2) fails, which Linux ≥ 3.17 does only for a bad buffer.
pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    random_bytes(&mut buf).expect("getrandom(2) failed");
    buf.iter().map(|b| format!("{b:02x}")).collect()
}
