//! Shutdown signals as a future, so servers take "when to stop" as a parameter and tests
//! can stop them without sending signals to the test process.

/// Resolves on the first SIGINT or SIGTERM (Ctrl-C elsewhere).
pub async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// SIGHUP as "reload", and SIGINT and SIGTERM as "stop", all installed before a server
/// announces its addresses: a signal sent as soon as the address is known reloads or stops
/// the server, rather than killing the process before its handler exists.
pub(crate) struct Reloads {
    #[cfg(unix)]
    hangup: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl Reloads {
    /// Installs the SIGHUP, SIGINT and SIGTERM handlers.
    pub(crate) fn install() -> std::io::Result<Self> {
        #[cfg(unix)]
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            #[cfg(unix)]
            hangup: signal(SignalKind::hangup())?,
            #[cfg(unix)]
            interrupt: signal(SignalKind::interrupt())?,
            #[cfg(unix)]
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// Calls `reload` at every SIGHUP until SIGINT or SIGTERM.
    pub(crate) async fn until_stopped(mut self, mut reload: impl FnMut()) {
        loop {
            #[cfg(unix)]
            tokio::select! {
                _ = self.interrupt.recv() => return,
                _ = self.terminate.recv() => return,
                _ = self.hangup.recv() => reload(),
            }
            #[cfg(not(unix))]
            {
                let _ = &mut reload;
                return signal().await;
            }
        }
    }
}

/// A cloneable trigger/listener pair: `Trigger::fire` resolves every `Shutdown::wait`.
#[derive(Clone, Debug)]
pub struct Shutdown {
    rx: tokio::sync::watch::Receiver<bool>,
}

/// The sending half of [`Shutdown`]; dropping it also counts as firing.
#[derive(Debug)]
pub struct Trigger {
    tx: tokio::sync::watch::Sender<bool>,
}

/// Creates a connected trigger and listener.
pub fn channel() -> (Trigger, Shutdown) {
    let (tx, rx) = tokio::sync::watch::channel(false);
    (Trigger { tx }, Shutdown { rx })
}

impl Trigger {
    /// Asks every listener to stop.
    pub fn fire(&self) {
        let _ = self.tx.send(true);
    }
}

impl Shutdown {
    /// Resolves once the trigger fired or was dropped.
    pub async fn wait(&mut self) {
        let _ = self.rx.wait_for(|fired| *fired).await;
    }

    /// True once the trigger fired.
    pub fn is_fired(&self) -> bool {
        *self.rx.borrow()
    }

    /// Consumes the listener: a `'static` future for APIs that take shutdown as a future.
    pub async fn signalled(mut self) {
        self.wait().await
    }
}
