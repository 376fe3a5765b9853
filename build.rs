//! Links `torpor-vmm` (and only it) as a static PIE on Linux/glibc, from
//! a plain `cargo build`: no dynamic loader at start (mapping libc and
//! libgcc_s, resolving symbols), no shared libraries' private pages per
//! VMM process. `torpor` and the tests stay dynamic.
//!
//! rustc links the standard library's system libraries dynamically unless
//! the whole compilation has `crt-static`, which cargo cannot set for one
//! binary. So the binary gets `-static-pie` from here, and a directory of
//! its own, searched first, in which each library rustc names (`-lc`,
//! `-lgcc_s`, ...) is a linker script that stands for the static archive
//! (`libc.a`, `libgcc_eh.a`, ...). Linking fails loudly when the host has
//! no static glibc (`libc6-dev` has it).
//!
//! `TORPOR_VMM_LINK` chooses: `static-pie` (the default), `dynamic` (as
//! before), or `static`: not position-independent, so the binary's
//! relocated data (~280 KiB, written by every process at start as a
//! static PIE relocates itself) stays shared with the file; the cost is
//! no address randomization of the binary's own code and data.

use std::path::PathBuf;

/// The libraries rustc links `std` with on linux-gnu, each with what
/// stands for it in a static link.
const STATIC_LIBS: &[(&str, &str)] = &[
    ("c", "GROUP(-l:libc.a -l:libgcc.a -l:libgcc_eh.a)"),
    ("gcc_s", "INPUT(-l:libgcc_eh.a -l:libgcc.a)"),
    ("m", "INPUT(-l:libm.a)"),
    ("pthread", "INPUT(-l:libpthread.a)"),
    ("dl", "INPUT(-l:libdl.a)"),
    ("rt", "INPUT(-l:librt.a)"),
    ("util", "INPUT(-l:libutil.a)"),
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=TORPOR_VMM_LINK");
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    let glibc = var("CARGO_CFG_TARGET_OS") == "linux" && var("CARGO_CFG_TARGET_ENV") == "gnu";
    let link = match var("TORPOR_VMM_LINK").as_str() {
        "" | "static-pie" => &["-static-pie"][..],
        "static" => &["-static", "-no-pie"][..],
        "dynamic" => return,
        other => panic!("TORPOR_VMM_LINK={other}: static-pie, static or dynamic"),
    };
    if !glibc {
        return;
    }
    let dir = PathBuf::from(var("OUT_DIR")).join("static-libs");
    std::fs::create_dir_all(&dir).expect("create the static link directory");
    for (name, script) in STATIC_LIBS {
        std::fs::write(dir.join(format!("lib{name}.so")), format!("{script}\n"))
            .expect("write a static link script");
    }
    for arg in link {
        println!("cargo:rustc-link-arg-bin=torpor-vmm={arg}");
    }
    println!("cargo:rustc-link-arg-bin=torpor-vmm=-L{}", dir.display());
}
