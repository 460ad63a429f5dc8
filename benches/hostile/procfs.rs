//! What a process costs, read from `/proc`: resident memory, open descriptors, CPU time; the
//! machine's load; and a sampler that keeps the peaks while an attack runs.

use std::sync::mpsc;
use std::time::Duration;

/// A field of `/proc/PID/status` in KiB (`VmRSS`, `VmHWM`).
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Open file descriptors of `pid`.
pub fn fd_count(pid: u32) -> Option<usize> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}

/// User plus system CPU seconds of `pid` (all its threads), from `/proc/PID/stat`.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name: state (0), ppid (1), ... utime (11), stime (12).
    let f: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
    Some(ticks as f64 / hz as f64)
}

/// The 1, 5 and 15 minute load averages: the machine is shared, so every figure comes with it.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Raises this process's soft `RLIMIT_NOFILE` to the hard limit; the children inherit it, so
/// thousands of connections are limited by the proxy's own behaviour, not by the default 1,024.
pub fn raise_nofile_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for both calls.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
    }
    lim.rlim_cur
}

/// Peaks seen by a [`Sampler`].
#[derive(Debug, Default, Clone, Copy)]
pub struct Peaks {
    /// Highest `VmRSS` sampled, KiB.
    pub rss_kib: u64,
    /// `VmHWM` when sampling stopped (the kernel's own peak), KiB.
    pub hwm_kib: u64,
    /// Most descriptors open at once.
    pub fds: usize,
}

/// Samples a process every 50 ms on a thread of its own, so a busy runtime in this process
/// cannot make it miss a peak.
pub struct Sampler {
    stop: mpsc::Sender<()>,
    thread: std::thread::JoinHandle<Peaks>,
}

impl Sampler {
    pub fn start(pid: u32) -> Self {
        let (stop, stopped) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            let mut peaks = Peaks::default();
            loop {
                peaks.rss_kib = peaks.rss_kib.max(status_kib(pid, "VmRSS").unwrap_or(0));
                peaks.fds = peaks.fds.max(fd_count(pid).unwrap_or(0));
                if let Some(hwm) = status_kib(pid, "VmHWM") {
                    peaks.hwm_kib = hwm;
                }
                match stopped.recv_timeout(Duration::from_millis(50)) {
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    _ => return peaks,
                }
            }
        });
        Sampler { stop, thread }
    }

    /// The peaks, with one last sample taken now.
    pub fn stop(self) -> Peaks {
        let _ = self.stop.send(());
        self.thread.join().expect("sampler thread")
    }
}

/// How a child ended, from `wait4`.
#[derive(Debug, Clone)]
pub struct Ended {
    /// `exit N` or `signal N`.
    pub how: String,
    /// Peak RSS in KiB (`ru_maxrss`: exact even for a child killed between two samples).
    pub max_rss_kib: u64,
    /// User plus system CPU seconds.
    pub cpu_secs: f64,
}

/// Waits for child `pid` (started with `std::process`, which does not reap it) and reads how
/// it ended.
pub fn wait_rusage(pid: u32) -> Ended {
    let mut status = 0;
    // SAFETY: zeroed rusage is a valid value to be written into.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers for the call's duration; `pid` is our own child.
    let rc = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut usage) };
    if rc < 0 {
        return Ended {
            how: format!("wait4: {}", std::io::Error::last_os_error()),
            max_rss_kib: 0,
            cpu_secs: f64::NAN,
        };
    }
    let how = if libc::WIFEXITED(status) {
        format!("exit {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        format!("signal {}", libc::WTERMSIG(status))
    } else {
        format!("status {status}")
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ended {
        how,
        max_rss_kib: usage.ru_maxrss as u64,
        cpu_secs: secs(usage.ru_utime) + secs(usage.ru_stime),
    }
}

/// Sends `signal` to `pid`.
pub fn kill(pid: u32, signal: libc::c_int) {
    // SAFETY: plain system call on a child of ours.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}
