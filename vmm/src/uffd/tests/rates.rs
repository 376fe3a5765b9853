//! Fault-rate measurement (cargo test --release -p torpor-vmm uffd -- --ignored --nocapture).

use super::minor_mode::minor;
use super::*;

/// Pins the calling thread to `cpu` (threads it spawns inherit the mask).
fn pin_to(cpu: usize) {
    // SAFETY: cpu_set_t is a plain bit array; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE (callers pass 0 or 1) and `set` is valid.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is this thread.
    let ret = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    assert_eq!(
        ret,
        0,
        "sched_setaffinity: {}",
        std::io::Error::last_os_error()
    );
}

/// Touches every page of `mem` once from a thread pinned to `cpu`; returns
/// pages/s.
fn touch_all(mem: &Mapping, cpu: usize) -> f64 {
    let (addr, pages) = (mem.addr, mem.len / PS);
    let elapsed = in_thread(move || {
        pin_to(cpu);
        let t0 = Instant::now();
        for i in 0..pages {
            // SAFETY: as in read_page.
            unsafe { std::ptr::read_volatile((addr + i * PS) as *const u8) };
        }
        t0.elapsed()
    });
    pages as f64 / elapsed.as_secs_f64()
}

fn report(what: &str, pages_per_s: f64) {
    println!(
        "{what:<58} {pages_per_s:>9.0} pages/s {:>7.2} us/page",
        1e6 / pages_per_s
    );
}

#[test]
#[ignore = "measurement; run with --release --ignored --nocapture"]
fn measure_fault_rates() {
    const MIB: usize = 64;
    let pages = (MIB << 20) / PS;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The server thread inherits this thread's CPU 0 pin; the toucher runs on
    // CPU 0 too (a wake-up is a context switch) or on CPU 1 (a cross-CPU
    // wake-up, as between a vCPU thread and the server).
    pin_to(0);
    let placements: Vec<(&str, usize)> = if cpus > 1 {
        vec![("same CPU", 0), ("other CPU", 1)]
    } else {
        vec![("same CPU", 0)]
    };

    // Every page holds data, so each fault is a copy (or a continue).
    let data = TempFile::new("rate", (MIB << 20) as u64);
    let chunk: Vec<u8> = (0..256).flat_map(|p| page_bytes(tag(0, p))).collect();
    for off in (0..MIB << 20).step_by(chunk.len()) {
        data.file.write_all_at(&chunk, off as u64).unwrap();
    }
    let holes = TempFile::new("rate-holes", (MIB << 20) as u64);
    let shm = memfd(|f| {
        for off in (0..MIB << 20).step_by(chunk.len()) {
            f.write_all_at(&chunk, off as u64).unwrap();
        }
    });

    for &(place, cpu) in &placements {
        let mem = Mapping::anonymous(MIB << 20);
        let (server, _f) = start(
            vec![mem.region(0)],
            Layers::new(data.handle(), vec![]),
            missing(vec![], None),
        );
        report(
            &format!("missing, data (pread + UFFDIO_COPY), {place}"),
            touch_all(&mem, cpu),
        );
        assert_eq!(server.stats().faults, pages as u64);
        drop(server);

        let mem = Mapping::anonymous(MIB << 20);
        let (server, _f) = start(
            vec![mem.region(0)],
            Layers::new(holes.handle(), vec![]),
            missing(vec![], None),
        );
        report(
            &format!("missing, holes (pread + UFFDIO_ZEROPAGE), {place}"),
            touch_all(&mem, cpu),
        );
        drop(server);

        let mem = Mapping::private_file(&shm, MIB << 20, 0);
        let (server, _f) = start(
            vec![mem.region(0)],
            Layers::new(shm.try_clone().unwrap(), vec![]),
            minor(vec![]),
        );
        report(
            &format!("minor, template pages (UFFDIO_CONTINUE), {place}"),
            touch_all(&mem, cpu),
        );
        assert_eq!(server.stats().faults, pages as u64);
        drop(server);
    }

    let mem = Mapping::anonymous(MIB << 20);
    let t0 = Instant::now();
    let (server, _f) = start(
        vec![mem.region(0)],
        Layers::new(data.handle(), vec![]),
        missing((0..pages as u64).collect(), None),
    );
    wait_until("the prefetch", || server.stats().prefetch_done);
    report(
        "missing, prefetch of every page (batches of 32)",
        pages as f64 / t0.elapsed().as_secs_f64(),
    );
    drop(server);

    let mem = Mapping::private_file(&shm, MIB << 20, 0);
    let t0 = Instant::now();
    let (server, _f) = start(
        vec![mem.region(0)],
        Layers::new(shm.try_clone().unwrap(), vec![]),
        minor((0..pages as u64).collect()),
    );
    wait_until("the prefetch", || server.stats().prefetch_done);
    report(
        "minor, prefetch of every page (batches of 32)",
        pages as f64 / t0.elapsed().as_secs_f64(),
    );
    drop(server);

    // Start latency (checks, /proc/self/maps, registration, thread spawn)
    // for a 2 GiB region: nothing in it depends on the size.
    let big = Mapping::anonymous(2 << 30);
    let big_base = TempFile::new("big", 2 << 30);
    let mut times: Vec<Duration> = (0..9)
        .map(|_| {
            let t0 = Instant::now();
            let (server, _f) = start(
                vec![big.region(0)],
                Layers::new(big_base.handle(), vec![]),
                missing(vec![], None),
            );
            let t = t0.elapsed();
            drop(server);
            t
        })
        .collect();
    times.sort();
    println!("start() over a 2 GiB region, median of 9: {:?}", times[4]);

    // For scale: the kernel alone, no userfaultfd.
    let mem = Mapping::private_file(&shm, MIB << 20, 0);
    report(
        "no userfaultfd: MAP_PRIVATE memfd read faults",
        touch_all(&mem, 0),
    );
    let mem = Mapping::anonymous(MIB << 20);
    report("no userfaultfd: anonymous read faults", touch_all(&mem, 0));
}
