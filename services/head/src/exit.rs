//! How a command ended, as the exit status a shell sees.

/// How a command ended, as its exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// 0: everything it did succeeded.
    Succeeded,
    /// 1: a rollout, a check or a server failed.
    Failed,
    /// 130: stopped by Ctrl-C before its work was done (128 + SIGINT, as shells report it).
    Interrupted,
}

impl From<bool> for Exit {
    fn from(succeeded: bool) -> Self {
        if succeeded {
            Self::Succeeded
        } else {
            Self::Failed
        }
    }
}

impl From<Exit> for std::process::ExitCode {
    fn from(exit: Exit) -> Self {
        match exit {
            Exit::Succeeded => Self::SUCCESS,
            Exit::Failed => Self::from(1),
            Exit::Interrupted => Self::from(130),
        }
    }
}
