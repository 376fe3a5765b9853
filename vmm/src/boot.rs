//! Direct 64-bit boot: load the kernel (ELF vmlinux or bzImage) and initrd
//! with linux-loader, write the command line and the zero page with its e820
//! map. The probe guest boots through exactly this path.

use std::fs::File;
use std::io::{Cursor, Read, Seek};
use std::path::{Path, PathBuf};

use linux_loader::cmdline::Cmdline;
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::{self, bzimage::BzImage, elf::Elf, KernelLoader, KernelLoaderResult};
use vm_memory::{
    Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    ReadVolatile,
};

use crate::layout::{CMDLINE_MAX_SIZE, CMDLINE_START, HIMEM_START, IDENTITY_PAGE, ZERO_PAGE};
use crate::vstate::memory::MMIO_GAP_START;

const E820_RAM: u32 = 1;
const E820_RESERVED: u32 = 2;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x0100_0000;
/// The 64-bit entry of a bzImage sits 0x200 bytes into the protected-mode code.
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;

/// Where the kernel image comes from: a file, or bytes built into torpor
/// (the probe guest).
#[derive(Debug, Clone)]
pub enum KernelImage {
    Path(PathBuf),
    Embedded {
        name: &'static str,
        bytes: &'static [u8],
    },
}

impl std::fmt::Display for KernelImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelImage::Path(p) => write!(f, "{}", p.display()),
            KernelImage::Embedded { name, .. } => write!(f, "builtin:{name}"),
        }
    }
}

/// Errors while loading the guest's boot images.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot open kernel {path}: {source}")]
    OpenKernel {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("kernel {0} is empty")]
    EmptyKernel(String),
    #[error("kernel {0} is neither an ELF vmlinux nor a bzImage")]
    UnknownKernelFormat(String),
    #[error("kernel {image} is truncated or corrupt: {detail}")]
    CorruptKernel { image: String, detail: String },
    #[error("cannot read initrd {path}: {source}")]
    Initrd {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("initrd {path} ({size} bytes) does not fit in guest memory below {limit:#x}")]
    InitrdTooLarge {
        path: PathBuf,
        size: u64,
        limit: u64,
    },
    #[error("invalid kernel command line: {0}")]
    Cmdline(linux_loader::cmdline::Error),
    #[error("cannot write the command line: {0}")]
    WriteCmdline(loader::Error),
    #[error("cannot write boot structures to guest memory: {0}")]
    GuestMemory(#[from] vm_memory::GuestMemoryError),
}

/// What the vCPU setup needs to know after loading.
#[derive(Debug, Clone, Copy)]
pub struct BootInfo {
    pub entry: GuestAddress,
}

/// Parses a command line string, enforcing the size limit.
pub fn parse_cmdline(cmdline: &str) -> Result<Cmdline, BootError> {
    let mut c = Cmdline::new(CMDLINE_MAX_SIZE).map_err(BootError::Cmdline)?;
    c.insert_str(cmdline).map_err(BootError::Cmdline)?;
    Ok(c)
}

/// Loads kernel, optional initrd and command line; writes the zero page.
pub fn load(
    mem: &GuestMemoryMmap,
    kernel: &KernelImage,
    initrd: Option<&Path>,
    cmdline: &Cmdline,
) -> Result<BootInfo, BootError> {
    let (loaded, entry) = match kernel {
        KernelImage::Path(path) => {
            let mut file = File::open(path).map_err(|source| BootError::OpenKernel {
                path: path.clone(),
                source,
            })?;
            load_kernel(mem, &mut file, &kernel.to_string())?
        }
        KernelImage::Embedded { bytes, .. } => {
            load_kernel(mem, &mut Cursor::new(*bytes), &kernel.to_string())?
        }
    };
    let mut params = boot_params::default();
    if let Some(hdr) = loaded.setup_header {
        params.hdr = hdr;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;

    loader::load_cmdline(mem, GuestAddress(CMDLINE_START), cmdline)
        .map_err(BootError::WriteCmdline)?;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline
        .as_cstring()
        .map(|c| c.as_bytes().len() as u32)
        .unwrap_or(0);

    if let Some(path) = initrd {
        let (addr, size) = load_initrd(mem, path)?;
        params.hdr.ramdisk_image = addr.0 as u32;
        params.hdr.ramdisk_size = size as u32;
    }
    add_e820_entries(&mut params, mem);
    mem.write_obj(params, GuestAddress(ZERO_PAGE))?;
    Ok(BootInfo { entry })
}

/// Tries ELF first, then bzImage; distinguishes "not a kernel" from "a
/// kernel that is cut short".
fn load_kernel<F>(
    mem: &GuestMemoryMmap,
    image: &mut F,
    name: &str,
) -> Result<(KernelLoaderResult, GuestAddress), BootError>
where
    F: Read + ReadVolatile + Seek,
{
    let len = image.seek(std::io::SeekFrom::End(0)).unwrap_or(0);
    if len == 0 {
        return Err(BootError::EmptyKernel(name.to_string()));
    }
    let corrupt = |e: loader::Error| BootError::CorruptKernel {
        image: name.to_string(),
        detail: e.to_string(),
    };
    match Elf::load(mem, None, image, Some(GuestAddress(HIMEM_START))) {
        Ok(r) => {
            let entry = r.kernel_load;
            return Ok((r, entry));
        }
        Err(loader::Error::Elf(loader::elf::Error::InvalidElfMagicNumber))
        | Err(loader::Error::Elf(loader::elf::Error::ReadElfHeader)) => {}
        Err(e) => return Err(corrupt(e)),
    }
    match BzImage::load(mem, None, image, Some(GuestAddress(HIMEM_START))) {
        Ok(r) => {
            let entry = r.kernel_load.unchecked_add(BZIMAGE_64BIT_ENTRY_OFFSET);
            Ok((r, entry))
        }
        Err(loader::Error::Bzimage(loader::bzimage::Error::InvalidBzImage))
        | Err(loader::Error::Bzimage(loader::bzimage::Error::ReadBzImageHeader)) => {
            Err(BootError::UnknownKernelFormat(name.to_string()))
        }
        Err(e) => Err(corrupt(e)),
    }
}

/// Places the initrd page-aligned at the top of low RAM (below the MMIO gap).
fn load_initrd(mem: &GuestMemoryMmap, path: &Path) -> Result<(GuestAddress, u64), BootError> {
    let err = |source| BootError::Initrd {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(err)?;
    let size = file.metadata().map_err(err)?.len();
    let low_end = mem
        .iter()
        .next()
        .map(|r| r.len())
        .unwrap_or(0)
        .min(MMIO_GAP_START);
    let addr = low_end
        .checked_sub(size)
        .map(|a| a & !0xfff)
        .filter(|a| *a >= HIMEM_START)
        .ok_or_else(|| BootError::InitrdTooLarge {
            path: path.to_path_buf(),
            size,
            limit: low_end,
        })?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut file, size as usize)?;
    Ok((GuestAddress(addr), size))
}

/// e820: conventional memory, then the identity page, EBDA and BIOS hole
/// reserved, then every RAM
/// region from 1 MiB up.
fn add_e820_entries(params: &mut boot_params, mem: &GuestMemoryMmap) {
    let mut entries = vec![
        (0, IDENTITY_PAGE, E820_RAM),
        (IDENTITY_PAGE, HIMEM_START - IDENTITY_PAGE, E820_RESERVED),
    ];
    for region in mem.iter() {
        let start = region.start_addr().0.max(HIMEM_START);
        let end = region.last_addr().0 + 1;
        if end > start {
            entries.push((start, end - start, E820_RAM));
        }
    }
    for (i, (addr, size, type_)) in entries.into_iter().enumerate() {
        params.e820_table[i] = boot_e820_entry {
            addr,
            size,
            r#type: type_,
        };
        params.e820_entries = i as u8 + 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::memory::ram_ranges;

    fn mem(mib: u64) -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&ram_ranges(mib << 20)).unwrap()
    }

    fn load_bytes(bytes: &'static [u8]) -> Result<BootInfo, BootError> {
        let kernel = KernelImage::Embedded {
            name: "test",
            bytes,
        };
        load(
            &mem(32),
            &kernel,
            None,
            &parse_cmdline("console=ttyS0").unwrap(),
        )
    }

    #[test]
    fn rejects_empty_and_foreign_images() {
        assert!(matches!(load_bytes(b""), Err(BootError::EmptyKernel(_))));
        let err = load_bytes(&[0x42u8; 4096]).unwrap_err();
        assert!(matches!(err, BootError::UnknownKernelFormat(_)), "{err}");
    }

    #[test]
    fn rejects_truncated_elf() {
        // A valid-looking ELF identification with nothing behind it.
        static TRUNCATED: [u8; 20] = [
            0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0x3e, 0,
        ];
        let err = load_bytes(&TRUNCATED).unwrap_err();
        assert!(
            matches!(
                err,
                BootError::CorruptKernel { .. } | BootError::UnknownKernelFormat(_)
            ),
            "{err}"
        );
    }

    #[test]
    fn e820_covers_low_and_high_ram() {
        let mut p = boot_params::default();
        add_e820_entries(&mut p, &mem(4096));
        assert_eq!(p.e820_entries, 4);
        let e = p.e820_table;
        assert_eq!({ e[2].addr }, HIMEM_START);
        assert_eq!({ e[2].size }, MMIO_GAP_START - HIMEM_START);
        assert_eq!({ e[3].addr }, 1 << 32);
        assert_eq!({ e[3].size }, (4096u64 << 20) - MMIO_GAP_START);
    }

    #[test]
    fn cmdline_too_long_is_an_error() {
        assert!(parse_cmdline(&"x".repeat(CMDLINE_MAX_SIZE + 1)).is_err());
    }

    #[test]
    fn initrd_errors_are_clear() {
        let err = load_initrd(&mem(32), Path::new("/nonexistent/initrd")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/initrd"));
    }
}
