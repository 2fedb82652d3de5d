pub mod prompts;
pub mod server;
