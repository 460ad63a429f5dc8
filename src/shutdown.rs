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
