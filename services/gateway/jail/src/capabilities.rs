//! Dropping every capability: the bounding and ambient sets and the process's own.

use crate::error::{Failed, last_os_error};

pub fn drop_all() -> Result<(), Failed> {
    // SAFETY: prctl and capset with valid arguments; errors are checked.
    unsafe {
        let mut cap = 0;
        // Until the kernel says there is no such capability.
        while libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) >= 0 {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) < 0
                && *libc::__errno_location() != libc::EPERM
            {
                return Err(last_os_error(&format!("dropping capability {cap}")));
            }
            cap += 1;
        }
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        );
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        const VERSION_3: u32 = 0x2008_0522;
        let header = Header {
            version: VERSION_3,
            pid: 0,
        };
        let data = [
            Data {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
            Data {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
        ];
        if libc::syscall(libc::SYS_capset, &header as *const Header, data.as_ptr()) < 0 {
            return Err(last_os_error("clearing capabilities"));
        }
    }
    Ok(())
}
