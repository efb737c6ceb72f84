//! What a row norm divides each row by, shared by the norm kernels (one
//! block per row, a row in registers, a row split over blocks).

use mtmc_actions::op::NormKind;

/// What a row norm divides each row by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Stat {
    /// The standard deviation around the row's mean (layer, group and
    /// instance norms): `rsqrt(var + ε)`.
    Deviation,
    /// The root mean square, the mean taken as 0 (RMS norm).
    Rms,
    /// The Euclidean length, the mean taken as 0: `1 / max(‖x‖₂, ε)`
    /// (`F.normalize` with p = 2).
    Length,
}

impl Stat {
    /// The statistic of a norm of `kind`.
    pub(super) fn of(kind: &NormKind) -> Stat {
        match kind {
            NormKind::Rms { .. } | NormKind::RmsAt { .. } => Stat::Rms,
            NormKind::Lp { .. } => Stat::Length,
            _ => Stat::Deviation,
        }
    }

    /// Whether the row's mean is taken out first (false: it is taken
    /// as 0).
    pub(super) fn centred(self) -> bool {
        self == Stat::Deviation
    }

    /// The factor a row is scaled by, from the sum of its squared
    /// deviations `squares` over `count` elements.
    pub(super) fn rstd(self, squares: &str, count: &str, eps: &str) -> String {
        match self {
            Stat::Length => format!("1.0f / fmaxf(sqrtf({squares}), {eps})"),
            Stat::Deviation | Stat::Rms => {
                format!("rsqrtf({squares} / (float){count} + {eps})")
            }
        }
    }
}
