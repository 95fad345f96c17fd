//! The sandbox's system-call filter. It denies with an error, never a kill, so Python raises a
//! clean `PermissionError` (or, for `clone3`, falls back to `clone`, which the filter checks).
//!
//! Denied with `EPERM`: new namespaces (`unshare`, `setns`, `clone` with a `CLONE_NEW*` flag),
//! mounting and pivoting, `bpf`, the key store, `io_uring`, `userfaultfd`, `perf_event_open`,
//! `ptrace` and cross-process memory access, kernel modules and kexec, clock and host
//! administration, `socket`/`socketpair` for every family but `AF_UNIX` (asyncio needs a Unix
//! socket pair; the mount namespace leaves no named socket of the host in view, and the network
//! namespace confines abstract ones), and memory no process would be seen holding: `memfd_create`
//! and `memfd_secret` (a memfd outlives every mapping of it) and System V shared memory and message
//! queues (`shmget`, `msgget`). What a run keeps in files is on its own tmpfs, which the gateway
//! counts. `clone3` gets `ENOSYS`: its flags sit behind a pointer the
//! filter cannot read, and C libraries fall back to `clone` on `ENOSYS` only.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Calls refused outright, whatever their arguments.
const DENIED: &[libc::c_long] = &[
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_bpf,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_userfaultfd,
    libc::SYS_memfd_create,
    libc::SYS_memfd_secret,
    libc::SYS_shmget,
    libc::SYS_msgget,
    libc::SYS_perf_event_open,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_pidfd_getfd,
    libc::SYS_kcmp,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_name_to_handle_at,
    libc::SYS_open_by_handle_at,
    libc::SYS_fanotify_init,
    libc::SYS_quotactl,
    libc::SYS_acct,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_reboot,
    libc::SYS_syslog,
    libc::SYS_vhangup,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_sethostname,
    libc::SYS_setdomainname,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_iopl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_ioperm,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_modify_ldt,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_uselib,
];

/// `clone` flags that make a namespace.
const NAMESPACE_FLAGS: &[libc::c_int] = &[
    libc::CLONE_NEWNS,
    libc::CLONE_NEWCGROUP,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
];

#[cfg(target_arch = "x86_64")]
const ARCH: TargetArch = TargetArch::x86_64;
#[cfg(target_arch = "aarch64")]
const ARCH: TargetArch = TargetArch::aarch64;

/// The filters to install, in order (each one is a separate seccomp program: seccompiler gives a
/// program a single on-match action, and `clone3` needs another errno than the rest).
pub fn programs() -> Result<Vec<BpfProgram>, seccompiler::Error> {
    let condition = |arg, op, value| SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value);
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|&nr| (nr, Vec::new())).collect();
    // Any namespace flag in clone's flags (argument 0 on both architectures).
    rules.insert(
        libc::SYS_clone,
        NAMESPACE_FLAGS
            .iter()
            .map(|&flag| {
                let flag = flag as u64;
                SeccompRule::new(vec![condition(0, SeccompCmpOp::MaskedEq(flag), flag)?])
            })
            .collect::<Result<_, _>>()?,
    );
    for call in [libc::SYS_socket, libc::SYS_socketpair] {
        rules.insert(
            call,
            vec![SeccompRule::new(vec![condition(
                0,
                SeccompCmpOp::Ne,
                libc::AF_UNIX as u64,
            )?])?],
        );
    }
    let eperm = SeccompAction::Errno(libc::EPERM as u32);
    let main: BpfProgram =
        SeccompFilter::new(rules, SeccompAction::Allow, eperm, ARCH)?.try_into()?;
    let clone3: BpfProgram = SeccompFilter::new(
        [(libc::SYS_clone3, Vec::new())].into(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        ARCH,
    )?
    .try_into()?;
    Ok(vec![with_x32_guard(main), clone3])
}

/// On x86_64 the x32 ABI reaches the same calls under numbers with bit 30 set, which a filter
/// keyed on the 64-bit numbers would let through: refuse every such number first.
#[cfg(target_arch = "x86_64")]
fn with_x32_guard(program: BpfProgram) -> BpfProgram {
    use seccompiler::sock_filter;
    const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const JGE_K: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
    const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    let op = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    let mut guarded = vec![
        // seccomp_data.arch at offset 4, .nr at offset 0.
        op(LD_W_ABS, 0, 0, 4),
        op(JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        op(RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
        op(LD_W_ABS, 0, 0, 0),
        op(JGE_K, 0, 1, X32_SYSCALL_BIT),
        op(RET_K, 0, 0, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
    ];
    guarded.extend(program);
    guarded
}

#[cfg(not(target_arch = "x86_64"))]
fn with_x32_guard(program: BpfProgram) -> BpfProgram {
    program
}

/// Installs `programs` on the calling thread (which must be the only one); `no_new_privs` must be
/// set already, as seccomp requires of an unprivileged caller.
pub fn install(programs: &[BpfProgram]) -> std::io::Result<()> {
    for program in programs {
        seccompiler::apply_filter(program).map_err(std::io::Error::other)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filters_compile_for_this_architecture() {
        let programs = programs().unwrap();
        assert_eq!(programs.len(), 2);
        // Every denied call and the clone and socket rules are in the main program.
        assert!(programs[0].len() > DENIED.len() + NAMESPACE_FLAGS.len());
        assert!(programs.iter().all(|p| p.len() < 4096));
    }
}
