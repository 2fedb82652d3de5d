//! The device kernels: their source, compiled at run time with NVRTC into a cubin for the
//! device (or PTX), and loaded into a module per device.

use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{result as nv, sys as nvs, Ptx};

use super::guard::panic_message;

/// The CUDA C++ source of the kernels.
const SOURCE: &str = include_str!("kernels.cu");

/// The loaded module of one device.
pub(crate) struct Kernels {
    _module: Arc<CudaModule>,
    pub rope_f32: CudaFunction,
    pub rope_f16: CudaFunction,
    pub rope_bf16: CudaFunction,
    /// How the module was built: `"cubin sm_XY"` or `"ptx"`.
    pub origin: String,
}

fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen libnvrtc by its usual names.
    catch_unwind(|| unsafe { nvs::is_culib_present() }).unwrap_or(false)
}

const NO_NVRTC: &str = "NVRTC library (libnvrtc.so) not found";

/// The NVRTC version, when libnvrtc loads.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    if !nvrtc_present() {
        return None;
    }
    catch_unwind(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: plain out-parameters.
        unsafe { nvs::nvrtcVersion(&mut major, &mut minor) }
            .result()
            .ok()
            .map(|_| (major, minor))
    })
    .ok()
    .flatten()
}

/// Compiles the kernels with NVRTC into a cubin for `sm_<major><minor>`, without a device.
/// Returns the cubin's size; `Err` says why not (no libnvrtc, or the compiler's log).
/// Never panics.
pub fn nvrtc_check(major: i32, minor: i32) -> std::result::Result<usize, String> {
    if !nvrtc_present() {
        return Err(NO_NVRTC.into());
    }
    compile(Some(&format!("sm_{major}{minor}"))).map(|c| c.len())
}

/// Compiles [`SOURCE`]: a cubin for `arch` (`"sm_90"`), or PTX for NVRTC's default virtual
/// architecture when `arch` is `None`. No fused multiply-adds, as on the host.
fn compile(arch: Option<&str>) -> std::result::Result<Vec<u8>, String> {
    catch_unwind(AssertUnwindSafe(|| compile_unguarded(arch)))
        .unwrap_or_else(|p| Err(format!("NVRTC: {}", panic_message(p.as_ref()))))
}

fn compile_unguarded(arch: Option<&str>) -> std::result::Result<Vec<u8>, String> {
    let src = CString::new(SOURCE).map_err(|e| e.to_string())?;
    let prog = nv::create_program(&src, Some(c"kv_kernels.cu"))
        .map_err(|e| format!("NVRTC program creation failed: {e}"))?;
    let mut opts = vec!["--fmad=false".to_string()];
    if let Some(a) = arch {
        opts.push(format!("--gpu-architecture={a}"));
    }
    // SAFETY: `prog` is a live program until destroyed below; out-buffers are sized by NVRTC.
    let out = unsafe {
        (|| {
            if let Err(e) = nv::compile_program(prog, &opts) {
                let log = nv::get_program_log(prog)
                    .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                    .unwrap_or_default();
                return Err(format!(
                    "NVRTC compilation for {} failed ({e}): {log}",
                    arch.unwrap_or("ptx")
                ));
            }
            if arch.is_some() {
                let mut n = 0usize;
                nvs::nvrtcGetCUBINSize(prog, &mut n)
                    .result()
                    .map_err(|e| format!("NVRTC cubin size: {e}"))?;
                let mut image = vec![0u8; n];
                nvs::nvrtcGetCUBIN(prog, image.as_mut_ptr() as *mut c_char)
                    .result()
                    .map_err(|e| format!("NVRTC cubin: {e}"))?;
                Ok(image)
            } else {
                // NUL-terminated text, as cuModuleLoadData wants it
                let ptx = nv::get_ptx(prog).map_err(|e| format!("NVRTC ptx: {e}"))?;
                Ok(ptx.into_iter().map(|c| c as u8).collect())
            }
        })()
    };
    // SAFETY: not used after this.
    let _ = unsafe { nv::destroy_program(prog) };
    out
}

/// Compiles and loads the kernels for the device of `ctx`: a cubin for its exact
/// architecture, or PTX (JIT-compiled by the driver) when that fails.
pub(crate) fn load_kernels(ctx: &Arc<CudaContext>) -> std::result::Result<Kernels, String> {
    if !nvrtc_present() {
        return Err(NO_NVRTC.into());
    }
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| format!("compute capability: {e}"))?;
    let arch = format!("sm_{major}{minor}");
    let load = |image: Vec<u8>, origin: String| -> std::result::Result<Kernels, String> {
        ctx.bind_to_thread().map_err(|e| e.to_string())?;
        let module = ctx
            .load_module(Ptx::from_binary(image))
            .map_err(|e| format!("loading the {origin} module: {e}"))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| format!("kernel {name}: {e}"))
        };
        Ok(Kernels {
            rope_f32: f("kv_rope_f32")?,
            rope_f16: f("kv_rope_f16")?,
            rope_bf16: f("kv_rope_bf16")?,
            _module: module.clone(),
            origin,
        })
    };
    let first = compile(Some(&arch)).and_then(|c| load(c, format!("cubin {arch}")));
    first.or_else(|e1| {
        compile(None)
            .and_then(|p| load(p, "ptx".into()))
            .map_err(|e2| format!("{e1}; PTX fallback: {e2}"))
    })
}
