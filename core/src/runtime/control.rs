//! Commands from the control thread (signals, the admin listener) to the workers.
//!
//! Each worker owns a [`ControlReceiver`]; the control side keeps the matching
//! [`ControlSender`]. A command goes through a channel, and one byte on a socket pair wakes the
//! worker's control task, which runs on the worker's own runtime like any connection — so a
//! worker never blocks on, or polls for, its commands, and nothing on a request path touches
//! them.

use std::io::{self, Write as _};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::sync::mpsc;

use monoio::io::AsyncReadRent;

use crate::config::Snapshot;
use crate::telemetry::accesslog::AccessLog;

/// What a worker is asked to do.
pub(crate) enum Command {
    /// Serve new requests on this snapshot; requests already running finish on theirs.
    Swap(Box<SwapTo>),
    /// Stop: accept nothing more, close idle connections, let requests in flight run for up to
    /// `grace` and then end them; then a last limiter exchange, the access log flushed and
    /// closed, and the worker's thread ends (it reports how it went to the control thread).
    Drain {
        grace: std::time::Duration,
        /// The listening sockets were handed to a successor: close this process's descriptors
        /// of them, but leave them listening.
        keep_listening: bool,
    },
}

/// A new configuration for one worker, with what the control thread prepared for it off the
/// worker (files are opened there, not on the worker's thread).
pub(crate) struct SwapTo {
    pub(crate) snapshot: Snapshot,
    /// The backends' health for the snapshot, one table for every worker.
    pub(crate) health: std::sync::Arc<crate::upstream::health::HealthTable>,
    /// `Some`: the access-log settings changed, and this is the worker's new writer (`None`:
    /// logging is now off). The old writer is flushed and closed by the worker.
    pub(crate) access_log: Option<Option<AccessLog>>,
    /// Told when the worker serves new requests on the snapshot.
    pub(crate) done: mpsc::Sender<usize>,
}

/// The control side's handle on one worker.
pub(crate) struct ControlSender {
    commands: mpsc::Sender<Command>,
    wake: StdUnixStream,
}

/// A worker's end: commands to take, and the socket that says there are some.
pub(crate) struct ControlReceiver {
    commands: mpsc::Receiver<Command>,
    wake: StdUnixStream,
}

/// A connected pair for one worker.
pub(crate) fn channel() -> io::Result<(ControlSender, ControlReceiver)> {
    let (tx, rx) = mpsc::channel();
    let (ours, theirs) = StdUnixStream::pair()?;
    // The control side never waits on a worker: a full socket buffer already means "wake up".
    ours.set_nonblocking(true)?;
    theirs.set_nonblocking(true)?;
    Ok((
        ControlSender {
            commands: tx,
            wake: ours,
        },
        ControlReceiver {
            commands: rx,
            wake: theirs,
        },
    ))
}

impl ControlSender {
    /// Hand `command` to the worker and wake it. Fails only when the worker has exited.
    pub(crate) fn send(&self, command: Command) -> Result<(), Command> {
        self.commands.send(command).map_err(|e| e.0)?;
        // WouldBlock: unread wake bytes are already waiting, which wakes it just the same.
        let _ = (&self.wake).write(&[1]);
        Ok(())
    }
}

impl ControlReceiver {
    /// Run `handle` on every command, in order, for as long as the control side lives. Runs as
    /// a task on the worker's runtime.
    pub(crate) async fn serve(self, mut handle: impl FnMut(Command)) {
        let Ok(mut wake) = monoio::net::UnixStream::from_std(self.wake) else {
            eprintln!("sluice: a worker cannot watch its control socket; reload and drain will not reach it");
            return;
        };
        let mut buf = vec![0u8; 64];
        loop {
            let (res, b) = wake.read(buf).await;
            buf = b;
            match res {
                // The control side is gone (the process is ending): nothing more will come.
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            while let Ok(command) = self.commands.try_recv() {
                handle(command);
            }
        }
    }
}
