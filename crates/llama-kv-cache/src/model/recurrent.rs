//! The recurrent state of recurrent and hybrid models: Mamba's `ssm_*` widths, RWKV's `wkv`
//! state, and the convolution and head states of LFM2, Kimi's delta attention and MiniMax's
//! lightning attention.

use crate::error::{KvError, Result};
use crate::model::arch;
use crate::model::hparams::{mul, HeadDims, Hparams, Keys};

/// Recurrent state dimensions.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct RecurrentInfo {
    /// `ssm.conv_kernel`.
    pub ssm_d_conv: u32,
    /// `ssm.inner_size`.
    pub ssm_d_inner: u32,
    /// `ssm.state_size`.
    pub ssm_d_state: u32,
    /// `ssm.time_step_rank`.
    pub ssm_dt_rank: u32,
    /// `ssm.group_count` (Mamba-2 groups of B and C; 0 for Mamba).
    pub ssm_n_group: u32,
    /// RWKV `wkv.head_size`.
    pub wkv_head_size: u32,
    /// RWKV `token_shift_count` (default 2).
    pub token_shift_count: u32,
    /// Rolling-state width per layer (`n_embd_k_s`).
    pub n_embd_k_s: u32,
    /// Recurrent-state width per layer (`n_embd_v_s`).
    pub n_embd_v_s: u32,
}

/// The recurrent state widths of the model; `None` when it has no recurrent layer.
pub(super) fn recurrent_info(
    k: &Keys,
    hp: &Hparams,
    heads: &HeadDims,
) -> Result<Option<RecurrentInfo>> {
    let (arch, n_embd) = (k.arch, hp.n_embd);
    if arch::is_rwkv(arch) {
        let wkv = k.u32_req("wkv.head_size")?;
        let shift = k.u32_opt("token_shift_count")?.unwrap_or(2);
        return Ok(Some(RecurrentInfo {
            wkv_head_size: wkv,
            token_shift_count: shift,
            n_embd_k_s: mul(shift, n_embd, "RWKV token-shift width")?,
            n_embd_v_s: mul(n_embd, wkv, "RWKV wkv state width")?,
            ..Default::default()
        }));
    }
    if !arch::is_recurrent(arch) && !arch::is_hybrid(arch) {
        return Ok(None);
    }
    let get = |s: &str| -> Result<u32> {
        if arch::is_recurrent(arch) {
            k.u32_req(s)
        } else {
            Ok(k.u32_opt(s)?.unwrap_or(0))
        }
    };
    let (d_conv, d_inner, d_state) = (
        get("ssm.conv_kernel")?,
        get("ssm.inner_size")?,
        get("ssm.state_size")?,
    );
    let n_group = k.u32_opt("ssm.group_count")?.unwrap_or(0);
    let n_head0 = hp.n_head[0];
    // Kimi's delta attention: the Q, K and V convolutions and one head_dim^2 state per head
    let kda = k.u32_opt("kda.head_dim")?.filter(|&d| d > 0);
    // MiniMax-01's lightning attention keeps one head_dim^2 state per head
    let la = (arch == "minimax-01").then_some(heads.n_embd_head_k);
    let n_embd_k_s = match (k.u32_opt("shortconv.l_cache")?.filter(|&l| l > 0), kda) {
        // LFM2's short convolutions keep the last `l_cache - 1` inputs
        (Some(l_cache), _) => mul(l_cache - 1, n_embd, "short-convolution state width")?,
        (None, Some(kda)) => {
            let taps = if d_conv > 0 { d_conv - 1 } else { 3 };
            mul(
                mul(3 * taps, n_head0, "KDA conv state width")?,
                kda,
                "KDA conv state width",
            )?
        }
        // Mamba-2 groups convolve B and C beside x
        (None, None) => {
            let bc = mul(2 * n_group, d_state, "SSM conv channels")?;
            let channels = d_inner.checked_add(bc).ok_or_else(|| {
                KvError::InvalidModel("SSM conv channels overflow a uint32".into())
            })?;
            mul(d_conv.saturating_sub(1), channels, "SSM conv state width")?
        }
    };
    let n_embd_v_s = match kda.or(la) {
        Some(head) => mul(mul(head, head, "head state width")?, n_head0, "state width")?,
        None => mul(d_state, d_inner, "SSM state width")?,
    };
    Ok(Some(RecurrentInfo {
        ssm_d_conv: d_conv,
        ssm_d_inner: d_inner,
        ssm_d_state: d_state,
        ssm_dt_rank: get("ssm.time_step_rank")?,
        ssm_n_group: n_group,
        token_shift_count: 0,
        n_embd_k_s,
        n_embd_v_s,
        ..Default::default()
    }))
}
