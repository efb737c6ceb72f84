//! Ctrl-C (SIGINT) and SIGTERM as a request to stop, for commands that
//! work through a list and can stop between two items: the first signal
//! sets a flag the command reads between items, so it reports what it
//! finished and keeps it; a second one ends the process at once (exit 130).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use signal_hook::consts::{SIGINT, SIGTERM};

/// A stop asked for by a signal, read between items of work (a clone reads
/// the same flag).
#[derive(Clone)]
pub struct Interrupt(Arc<AtomicBool>);

impl Interrupt {
    /// A stop no signal sets: [`Interrupt::request`] alone does (a caller
    /// that handles signals itself, or none).
    pub fn new() -> Interrupt {
        Interrupt(Arc::new(AtomicBool::new(false)))
    }

    /// Asks for a stop, as a first signal would.
    pub fn request(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Catches SIGINT and SIGTERM from now until the process ends: the
    /// first sets the flag, a second exits at once with status 130. The
    /// binary calls this for a command that reads [`Interrupt::requested`]
    /// until it returns (the library never does: the signals no longer end
    /// the process by themselves).
    pub fn catch() -> std::io::Result<Interrupt> {
        let flag = Arc::new(AtomicBool::new(false));
        for signal in [SIGINT, SIGTERM] {
            // The exit goes first: it acts only once the flag is set, that
            // is, on the second signal.
            signal_hook::flag::register_conditional_shutdown(signal, 130, Arc::clone(&flag))?;
            signal_hook::flag::register(signal, Arc::clone(&flag))?;
        }
        Ok(Interrupt(flag))
    }

    /// Whether a stop was asked for.
    pub fn requested(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

impl Default for Interrupt {
    fn default() -> Interrupt {
        Interrupt::new()
    }
}

/// The error a command returns after it stopped on a signal and reported
/// what it finished; `main` exits with status 130 on it.
#[derive(Debug)]
pub struct Interrupted(pub String);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted: {}", self.0)
    }
}

impl std::error::Error for Interrupted {}
