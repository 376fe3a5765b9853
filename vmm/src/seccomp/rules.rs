//! Building allow-lists: syscalls allowed outright, or only with certain
//! arguments, and the calls every thread needs.

use std::collections::BTreeMap;

use seccompiler::{SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};

use super::SeccompError;

/// One thread kind's allow-list under construction.
#[derive(Debug, Default)]
pub struct Rules {
    map: BTreeMap<i64, Vec<SeccompRule>>,
    /// Syscalls allowed only with some arguments (for the docs' counts).
    conditional: std::collections::BTreeSet<i64>,
}

/// An argument test: `arg` (0-based) compared with `value`.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    /// The 32-bit argument equals the value (ioctl requests, flags).
    Eq(u8, u64),
    /// The argument's bits under `mask` equal the value's.
    Masked(u8, u64, u64),
}

impl Rules {
    /// Allows each of `syscalls` whatever their arguments.
    pub fn allow(&mut self, syscalls: &[libc::c_long]) -> &mut Self {
        for &s in syscalls {
            // An unconditional allow wins over any rule set earlier.
            self.map.insert(s, Vec::new());
            self.conditional.remove(&s);
        }
        self
    }

    /// Allows `syscall` when all of `args` hold; several calls add
    /// alternatives. A syscall already allowed outright stays so.
    pub fn allow_if(
        &mut self,
        syscall: libc::c_long,
        args: &[Arg],
    ) -> Result<&mut Self, SeccompError> {
        if self.map.get(&syscall).is_some_and(|r| r.is_empty()) {
            return Ok(self);
        }
        let rule_err = |source| SeccompError::Rule { syscall, source };
        let conditions = args
            .iter()
            .map(|a| match *a {
                Arg::Eq(index, value) => {
                    SeccompCondition::new(index, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, value)
                }
                Arg::Masked(index, mask, value) => SeccompCondition::new(
                    index,
                    SeccompCmpArgLen::Qword,
                    SeccompCmpOp::MaskedEq(mask),
                    value,
                ),
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(rule_err)?;
        let rule = SeccompRule::new(conditions).map_err(rule_err)?;
        self.map.entry(syscall).or_default().push(rule);
        self.conditional.insert(syscall);
        Ok(self)
    }

    /// Allows `syscall` with argument `arg` equal to any of `values`
    /// (ioctl request numbers, socket families, signals).
    pub fn allow_values(
        &mut self,
        syscall: libc::c_long,
        arg: u8,
        values: &[u64],
    ) -> Result<&mut Self, SeccompError> {
        for &v in values {
            self.allow_if(syscall, &[Arg::Eq(arg, v)])?;
        }
        Ok(self)
    }

    /// Whether `syscall` is allowed in some form.
    pub fn allows(&self, syscall: libc::c_long) -> bool {
        self.map.contains_key(&syscall)
    }

    /// Whether `syscall` is allowed only with some arguments.
    pub fn is_conditional(&self, syscall: libc::c_long) -> bool {
        self.conditional.contains(&syscall)
    }

    /// How many alternative argument rules allow `syscall` (for ioctl:
    /// how many request numbers).
    pub fn rule_count(&self, syscall: libc::c_long) -> usize {
        self.map.get(&syscall).map_or(0, Vec::len)
    }

    /// The allowed syscall numbers.
    pub fn syscalls(&self) -> impl Iterator<Item = i64> + '_ {
        self.map.keys().copied()
    }

    pub fn into_map(self) -> BTreeMap<i64, Vec<SeccompRule>> {
        self.map
    }
}

/// What every confined thread needs: memory management without
/// executable mappings, futexes, signals delivered to it, time, sleeping,
/// logging to stderr, closing and ending itself.
pub fn base() -> Result<Rules, SeccompError> {
    let mut r = Rules::default();
    r.allow(&[
        libc::SYS_futex,
        libc::SYS_rt_sigreturn,
        libc::SYS_rt_sigprocmask,
        libc::SYS_sigaltstack,
        libc::SYS_exit,
        libc::SYS_exit_group,
        libc::SYS_munmap,
        libc::SYS_brk,
        libc::SYS_mremap,
        libc::SYS_sched_yield,
        libc::SYS_clock_gettime,
        libc::SYS_clock_nanosleep,
        libc::SYS_nanosleep,
        libc::SYS_gettid,
        libc::SYS_getpid,
        libc::SYS_close,
        libc::SYS_write,
    ]);
    // No executable memory: a thread that could map or make pages
    // executable could run code the guest handed it.
    let no_exec = Arg::Masked(2, libc::PROT_EXEC as u64, 0);
    r.allow_if(libc::SYS_mmap, &[no_exec])?;
    r.allow_if(libc::SYS_mprotect, &[no_exec])?;
    // A thread may abort itself (a failed assertion dies as SIGABRT, not
    // as a seccomp kill).
    r.allow_if(libc::SYS_tgkill, &[Arg::Eq(2, libc::SIGABRT as u64)])?;
    // Giving memory back: freed heap, a finished thread's stack.
    r.allow_if(libc::SYS_madvise, &[Arg::Eq(2, libc::MADV_DONTNEED as u64)])?;
    // Debug builds of std check that a descriptor is open before closing
    // it (F_GETFD reads one flag of the caller's own descriptor).
    r.allow_if(libc::SYS_fcntl, &[Arg::Eq(1, libc::F_GETFD as u64)])?;
    Ok(r)
}

/// fcntl as std uses it on descriptors a thread owns: descriptor and
/// status flags, and `try_clone` (F_DUPFD_CLOEXEC). No locks, no owners,
/// no signals.
pub fn allow_fd_flags(r: &mut Rules) -> Result<(), SeccompError> {
    r.allow_values(
        libc::SYS_fcntl,
        1,
        &[
            libc::F_GETFD as u64,
            libc::F_SETFD as u64,
            libc::F_GETFL as u64,
            libc::F_SETFL as u64,
            libc::F_DUPFD_CLOEXEC as u64,
        ],
    )?;
    Ok(())
}
